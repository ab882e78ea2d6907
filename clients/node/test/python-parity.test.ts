/**
 * The same pipeline from Node and from the Python SDK, on one server: same seed, same
 * data, same losses and learning rates -> the same logprobs to the last bit (CPU fp32)
 * and the same metrics. test/py_reference.py runs the Python side first (so the two
 * models' calls never batch together) and prints its data and results.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { test } from "node:test";
import { type Datum, type LossFnName } from "../src/index.js";
import { PYTHON, ROOT, TINY, sharedService } from "./harness.js";

interface Reference {
  seed: number;
  rank: number;
  data: Datum[];
  steps: {
    loss: LossFnName;
    config: Record<string, number>;
    lr: number;
    logprobs: string[][];
    metrics: Record<string, number>;
    step: number;
    optimMetrics: Record<string, number>;
  }[];
  final: string[][];
}

const shared = sharedService();

/** float32 values as the hex of their little-endian bytes, as numpy's tobytes().hex(). */
function bits(values: ArrayLike<number>): string[] {
  const buf = Buffer.alloc(4);
  return Array.from(values, (v) => {
    buf.writeFloatLE(v);
    return buf.toString("hex");
  });
}

test("forwardBackward + optimStep from Node equal the Python SDK's, bit for bit", async () => {
  const script = join(ROOT, "clients", "node", "test", "py_reference.py");
  const py = spawnSync(PYTHON, [script, shared.server.address, shared.server.apiKey, TINY], { encoding: "utf8", timeout: 300_000 });
  assert.equal(py.status, 0, py.stderr);
  const ref = JSON.parse(py.stdout) as Reference;

  const trainer = await shared.service.createLoraTrainingClient(TINY, { rank: ref.rank, seed: ref.seed });
  // Same pipelining as Python: both calls of a step in flight before either answers.
  for (const [i, want] of ref.steps.entries()) {
    const [out, step] = await Promise.all([
      trainer.forwardBackward(ref.data, want.loss, { lossFnConfig: want.config }),
      trainer.optimStep({ learningRate: want.lr }),
    ]);
    assert.deepEqual(out.lossFnOutputs.map((o) => bits(o.logprobs)), want.logprobs, `step ${i} logprobs`);
    assert.deepEqual(out.metrics, want.metrics, `step ${i} metrics`);
    assert.equal(step.step, want.step);
    assert.deepEqual(step.metrics, want.optimMetrics, `step ${i} optimizer metrics`);
  }
  const final = await trainer.forwardLogprobs(ref.data);
  assert.deepEqual(final.lossFnOutputs.map((o) => bits(o.logprobs)), ref.final);
  assert.notDeepEqual(ref.final, ref.steps[0]!.logprobs, "training moved the logprobs");
});
