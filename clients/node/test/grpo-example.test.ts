/** examples/grpo.ts learns: a short run (the demo's warm-up, then a few GRPO steps)
 * whose rollout reward rises. */
import assert from "node:assert/strict";
import { test } from "node:test";
import { PLAN, runGrpo } from "../examples/grpo.js";
import { DEMO, sharedService } from "./harness.js";

const shared = sharedService();

test("the GRPO example's reward rises", async () => {
  const lines: string[] = [];
  const plan = { ...PLAN, baseModel: DEMO, rlSteps: 16 };
  const { history, sftAccuracy } = await runGrpo(shared.service, plan, (line) =>
    lines.push(line),
  );
  console.log(lines.join("\n"));
  assert.equal(history.length, plan.rlSteps);
  assert.ok(sftAccuracy >= plan.sftTarget, `warm-up reached ${sftAccuracy}`);
  const reward = history.map((m) => m.reward);
  const k = 4;
  const first = reward.slice(0, k).reduce((a, b) => a + b) / k;
  const last = reward.slice(-k).reduce((a, b) => a + b) / k;
  assert.ok(last >= first + 0.05, `reward ${first.toFixed(3)} -> ${last.toFixed(3)}: ${reward.map((r) => r.toFixed(2))}`);
});
