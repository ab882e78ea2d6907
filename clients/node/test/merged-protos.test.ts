/**
 * What the merged protos added, through @treadle/client against a live `treadle serve`:
 * forwardLogprobs against a saved state or a kept version, the LoRA module flags,
 * SamplingParams presence (explicit 0 = greedy, topK 1 = greedy, unset = server
 * default), a string stop as one stop string (the same tokens as the Python SDK's),
 * stoppedBy, NoGradientWarning and the training-pass metrics of getServerInfo.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { after, before, describe, test } from "node:test";
import {
  type Datum,
  InvalidArgumentError,
  type SamplingClient,
  ServiceClient,
  type TrainingClient,
  type TreadleError,
} from "../src/index.js";
import { PYTHON, TINY, type TestServer, testServer } from "./harness.js";

let server: TestServer;
let service: ServiceClient;
let data: Datum[];
let prompt: number[];

before(async () => {
  server = await testServer();
  service = new ServiceClient({ address: server.address, apiKey: server.apiKey, timeoutS: 120 });
  const tok = await service.getTokenizer(TINY);
  const datum = (tokens: number[]): Datum => ({
    modelInput: tokens.slice(0, -1),
    lossFnInputs: { target_tokens: tokens.slice(1), weights: tokens.slice(1).map(() => 1) },
  });
  data = ["1+2=3", "4+4=8", "9+1=10"].map((s) => datum([tok.bosTokenId!, ...tok.encode(s)]));
  prompt = [tok.bosTokenId!, ...tok.encode("2+3=")];
});
after(async () => {
  service.close();
  await server.stop();
});

async function rejectsNaming(promise: Promise<unknown>, field: string): Promise<TreadleError> {
  const err = await promise.then(
    () => assert.fail(`expected InvalidArgumentError naming ${field}`),
    (e: unknown) => e,
  );
  assert.ok(err instanceof InvalidArgumentError, String(err));
  assert.ok((err as TreadleError).details.includes(field), `"${(err as TreadleError).details}" does not name ${field}`);
  return err as TreadleError;
}

async function logprobs(trainer: TrainingClient, reference?: boolean | string): Promise<number[][]> {
  const out = await trainer.forwardLogprobs(data, reference === undefined ? {} : { reference });
  return out.lossFnOutputs.map((o) => Array.from(o.logprobs));
}

function maxDiff(a: number[][], b: number[][]): number {
  assert.deepEqual(a.map((x) => x.length), b.map((x) => x.length));
  return Math.max(...a.flatMap((row, i) => row.map((v, j) => Math.abs(v - b[i]![j]!))));
}

async function step(trainer: TrainingClient, lr = 0.05): Promise<void> {
  await Promise.all([trainer.forwardBackward(data), trainer.optimStep({ learningRate: lr })]);
}

describe("forwardLogprobs against a reference path", () => {
  test("a saved state or a kept version as the reference: the logprobs of those weights loaded", async () => {
    const trainer = await service.createLoraTrainingClient(TINY, { rank: 4, seed: 5 });
    await step(trainer);
    const saved = await trainer.saveState("warm");
    const sampler = await trainer.syncWeights();
    assert.equal(sampler.version, 1);
    const atWarm = await logprobs(trainer);
    assert.ok(maxDiff(await logprobs(trainer, saved.path), atWarm) < 1e-6, "right after saving, the reference is the policy");

    await step(trainer);
    const now = await logprobs(trainer);
    assert.ok(maxDiff(now, atWarm) > 1e-3, "training moved the policy");
    const loaded = await service.createTrainingClientFromState(saved.path);
    try {
      const fromState = await logprobs(trainer, saved.path);
      assert.ok(maxDiff(fromState, await logprobs(loaded)) < 1e-6, "reference = that state loaded as a model");
      const fromVersion = await logprobs(trainer, `treadle://${trainer.modelId}/v/1`);
      assert.ok(maxDiff(fromVersion, atWarm) < 1e-6, "reference = the kept version 1");
      assert.ok(maxDiff(await logprobs(trainer, true), fromState) > 1e-3, "the base model is another reference");
      // The reference calls changed nothing.
      assert.deepEqual(await logprobs(trainer), now);
    } finally {
      await service.deleteModel(loaded.modelId);
    }

    const next = (await trainer.getInfo()).nextSeqId;
    await rejectsNaming(trainer.forwardLogprobs(data, { reference: "" }), "reference");
    await rejectsNaming(trainer.forwardLogprobs(data, { reference: 1 as never }), "reference");
    assert.equal((await trainer.getInfo()).nextSeqId, next, "refused before sending: no seq_id taken");
    // What only the server can check comes back typed, naming the wire field.
    await rejectsNaming(trainer.forwardLogprobs(data, { reference: "s3://bucket/warm" }), "reference_path");
    await service.deleteModel(trainer.modelId);
  });
});

describe("LoRA module flags", () => {
  test("all three false is refused before sending; each flag reaches the server", async () => {
    const models = (await service.listModels()).length;
    const err = await rejectsNaming(
      service.createLoraTrainingClient(TINY, { rank: 2, trainAttn: false, trainMlp: false, trainUnembed: false }),
      "trainMlp",
    );
    assert.match(err.details, /trainAttn/);
    assert.match(err.details, /trainUnembed/);
    await rejectsNaming(service.createLoraTrainingClient(TINY, { trainAttn: "no" as never }), "trainAttn");
    assert.equal((await service.listModels()).length, models, "no model was created");

    // Same seed, same data, same step: the adapted modules decide where the step lands.
    const all = await service.createLoraTrainingClient(TINY, { rank: 4, seed: 9 });
    const headOnly = await service.createLoraTrainingClient(TINY, {
      rank: 4,
      seed: 9,
      trainAttn: false,
      trainMlp: false,
      trainUnembed: true,
    });
    const noHead = await service.createLoraTrainingClient(TINY, { rank: 4, seed: 9, trainUnembed: false });
    try {
      const base = await logprobs(all);
      for (const t of [all, headOnly, noHead]) await step(t);
      const [a, h, n] = [await logprobs(all), await logprobs(headOnly), await logprobs(noHead)];
      for (const moved of [a, h, n]) assert.ok(maxDiff(moved, base) > 1e-4, "each model learned");
      assert.ok(maxDiff(a, h) > 1e-5 && maxDiff(a, n) > 1e-5 && maxDiff(h, n) > 1e-5, "the flags were applied");
    } finally {
      for (const t of [all, headOnly, noHead]) await service.deleteModel(t.modelId);
    }
  });
});

describe("SamplingParams", () => {
  let sampler: SamplingClient;
  before(async () => {
    sampler = await service.createSamplingClient({ baseModel: TINY });
  });

  test("topP 0 is refused client-side, naming samplingParams.topP", async () => {
    // The server's own check names top_p: the client's name proves nothing was sent.
    const err = await rejectsNaming(sampler.sample(prompt, 1, { topP: 0 }), "samplingParams.topP");
    assert.doesNotMatch(err.details, /top_p/);
    await rejectsNaming(sampler.sample(prompt, 1, { topK: -2 }), "samplingParams.topK");
  });

  test("explicit temperature 0 and topK 1 are greedy; unset knobs sample at the server's T = 1", async () => {
    const greedy = await sampler.sample(prompt, 3, { maxTokens: 8, temperature: 0, ignoreEos: true });
    const path = greedy.sequences[0]!.tokens;
    assert.equal(path.length, 8);
    for (const s of greedy.sequences) assert.deepEqual(s.tokens, path);
    const topK1 = await sampler.sample(prompt, 2, { maxTokens: 8, topK: 1, seed: 3, ignoreEos: true });
    for (const s of topK1.sequences) assert.deepEqual(s.tokens, path);
    const free = await sampler.sample(prompt, 4, { maxTokens: 8, seed: 3, ignoreEos: true });
    assert.ok(
      free.sequences.some((s) => s.tokens.join() !== path.join()),
      "unset temperature/topK sampled, not greedy",
    );
  });

  test("a string stop is one stop string (stoppedBy stop_string), the same as the Python SDK's", async () => {
    const tok = await service.getTokenizer(TINY);
    const params = { maxTokens: 24, temperature: 0, ignoreEos: true };
    const path = (await sampler.sample(prompt, 1, params)).sequences[0]!.tokens;
    const isPrefix = (xs: number[]) => xs.join() === path.slice(0, xs.length).join();
    // A stop string of two tokens' text whose split into characters would stop earlier:
    // read as one string it must not be split.
    let found = false;
    for (let k = 1; k + 1 < path.length && !found; k++) {
      const s = tok.decode([path[k]!, path[k + 1]!], { skipSpecialTokens: false });
      if (s.length < 2) continue;
      const whole = (await sampler.sample(prompt, 1, { ...params, stop: s })).sequences[0]!;
      const split = (await sampler.sample(prompt, 1, { ...params, stop: [...s] })).sequences[0]!;
      if (whole.stoppedBy !== "stop_string" || split.tokens.length >= whole.tokens.length) continue;
      found = true;
      assert.equal(whole.stopReason, "stop");
      assert.ok(isPrefix(whole.tokens) && whole.tokens.length <= k + 2, "stopped where the string completed");
      assert.ok(tok.decode(whole.tokens, { skipSpecialTokens: false }).includes(s));
      const asArray = (await sampler.sample(prompt, 1, { ...params, stop: [s] })).sequences[0]!;
      assert.deepEqual(asArray.tokens, whole.tokens);

      const py = spawnSync(
        PYTHON,
        [
          "-c",
          `import json, sys, treadle
address, key, base, stop, prompt = sys.argv[1:6]
with treadle.ServiceClient(address, api_key=key, session=False) as c:
    seq = c.create_sampling_client(base).sample(json.loads(prompt), 1, treadle.SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, stop=stop)).result().sequences[0]
    print(json.dumps({"tokens": seq.tokens, "stoppedBy": seq.stopped_by, "stopReason": seq.stop_reason}))`,
          server.address,
          server.apiKey,
          TINY,
          s,
          JSON.stringify(prompt),
        ],
        { encoding: "utf8", timeout: 120_000 },
      );
      assert.equal(py.status, 0, py.stderr);
      assert.deepEqual(JSON.parse(py.stdout), {
        tokens: whole.tokens,
        stoppedBy: whole.stoppedBy,
        stopReason: whole.stopReason,
      });
    }
    assert.ok(found, `no two-token stop string told one string from its characters in ${path}`);

    // A stop token id ends the sequence on that token.
    const at = 3;
    const first = path.indexOf(path[at]!);
    const byToken = (await sampler.sample(prompt, 1, { ...params, stop: [path[at]!] })).sequences[0]!;
    assert.equal(byToken.stoppedBy, "stop_token");
    assert.deepEqual(byToken.tokens, path.slice(0, first + 1));
    const byLength = (await sampler.sample(prompt, 1, params)).sequences[0]!;
    assert.equal(byLength.stopReason, "length");
    assert.equal(byLength.stoppedBy, undefined);
  });
});

test("optimStep without a gradient warns NoGradientWarning; getServerInfo reports training passes", async () => {
  const trainer = await service.createLoraTrainingClient(TINY, { rank: 2 });
  const seen: Error[] = [];
  const listener = (w: Error) => seen.push(w);
  process.on("warning", listener);
  try {
    const res = await trainer.optimStep();
    await new Promise((r) => setImmediate(r));
    assert.equal(res.metrics["no_grad:value"], 1);
    assert.deepEqual(seen.map((w) => w.name), ["NoGradientWarning"]);
    seen.length = 0;
    await step(trainer);
    await new Promise((r) => setImmediate(r));
    assert.deepEqual(seen, [], "a step with a gradient does not warn");
  } finally {
    process.off("warning", listener);
    await service.deleteModel(trainer.modelId);
  }
  const info = await service.getServerInfo();
  const tiny = info.trainingPassMetrics.find((p) => p.baseModel === TINY);
  assert.ok(tiny, JSON.stringify(info.trainingPassMetrics));
  assert.ok(tiny.passes > 0 && tiny.callsAlone + tiny.callsBatched >= tiny.passes);
  assert.equal(typeof tiny.callsPerBatchedPass, "number");
  assert.ok(info.samplerMetrics.some((m) => m.baseModel === TINY && m.tokensGenerated > 0));
});
