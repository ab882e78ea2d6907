/**
 * The conversions the merged protos changed, checked on the wire bytes (no server):
 * unset SamplingParams knobs stay unset (explicit 0 is sent), `stop` as one string or
 * strings and token ids, the client-side range checks naming the field, StopReason ->
 * stopReason + stoppedBy, every generated loss by its name, NoGradientWarning, and
 * the server-info pass metrics.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import * as convert from "../src/convert.js";
import { LossFn, StopReason } from "../src/gen/treadle/v1/common.js";
import { SamplerPlacement, SamplingParams as SamplingParamsPb } from "../src/gen/treadle/v1/sampling.js";
import { InvalidArgumentError, type SamplingParams, type TreadleError } from "../src/index.js";

/** The params as they travel: encoded, then decoded (presence survives the round trip). */
function onTheWire(params: SamplingParams | undefined): SamplingParamsPb {
  return SamplingParamsPb.decode(SamplingParamsPb.encode(convert.samplingParamsToWire(params)).finish());
}

function throwsNaming(fn: () => unknown, field: string): void {
  assert.throws(fn, (err: unknown) => {
    assert.ok(err instanceof InvalidArgumentError, String(err));
    assert.ok((err as TreadleError).details.includes(field), `"${(err as TreadleError).details}" does not name ${field}`);
    return true;
  });
}

test("unset sampling knobs are not sent; explicit values, 0 included, are", () => {
  const unset = onTheWire({});
  assert.equal(unset.temperature, undefined);
  assert.equal(unset.topP, undefined);
  assert.equal(unset.topK, undefined);
  assert.equal(unset.seed, undefined);
  assert.equal(unset.maxTokens, 16);
  // Only max_tokens (field 1) is on the wire: no default value for an unset knob.
  assert.deepEqual([...SamplingParamsPb.encode(convert.samplingParamsToWire({})).finish()], [0x08, 16]);
  const explicit = onTheWire({ temperature: 0, topP: 1, topK: 0, seed: 0 });
  assert.equal(explicit.temperature, 0);
  assert.equal(explicit.topP, 1);
  assert.equal(explicit.topK, 0);
  assert.equal(explicit.seed, 0);
  assert.equal(onTheWire({ topK: -1, topP: 0.5 }).topK, -1);
});

test("cacheCompletion travels as cache_completion (field 10); unset it is not sent", () => {
  assert.equal(onTheWire({ cacheCompletion: true }).cacheCompletion, true);
  assert.equal(onTheWire({}).cacheCompletion, false);
  assert.deepEqual([...SamplingParamsPb.encode(convert.samplingParamsToWire({ cacheCompletion: true })).finish()], [0x08, 16, 0x50, 1]);
});

test("a string stop is ONE stop string; an array mixes stop strings and token ids", () => {
  assert.deepEqual(onTheWire({ stop: "</answer>" }).stop, ["</answer>"]);
  assert.deepEqual(onTheWire({ stop: "</answer>" }).stopTokenIds, []);
  const mixed = onTheWire({ stop: ["\n\n", 7, "END", 0] });
  assert.deepEqual(mixed.stop, ["\n\n", "END"]);
  assert.deepEqual(mixed.stopTokenIds, [7, 0]);
  assert.deepEqual(onTheWire({}).stop, []);
  throwsNaming(() => convert.samplingParamsToWire({ stop: 5 as never }), "samplingParams.stop");
  throwsNaming(() => convert.samplingParamsToWire({ stop: ["a", 1.5] }), "samplingParams.stop[1]");
  throwsNaming(() => convert.samplingParamsToWire({ stop: [-1] }), "samplingParams.stop[0]");
  throwsNaming(() => convert.samplingParamsToWire({ stop: [null] as never }), "samplingParams.stop[0]");
});

test("out-of-range knobs are refused before sending, naming the field", () => {
  for (const topP of [0, -0.1, 1.5, Number.NaN, "0.5"]) {
    throwsNaming(() => convert.samplingParamsToWire({ topP: topP as number }), "samplingParams.topP");
  }
  throwsNaming(() => convert.samplingParamsToWire({ topK: -2 }), "samplingParams.topK");
  throwsNaming(() => convert.samplingParamsToWire({ topK: 1.5 }), "samplingParams.topK");
  throwsNaming(() => convert.samplingParamsToWire({ temperature: -0.5 }), "samplingParams.temperature");
  throwsNaming(() => convert.samplingParamsToWire({ temperature: Infinity }), "samplingParams.temperature");
});

test("the three ways of stopping read as stopReason 'stop' with stoppedBy, as in Python", () => {
  const seq = (stopReason: StopReason) =>
    convert.sequenceFromWire(
      { tokens: convert.int64Tensor([5]), logprobs: convert.floatTensor([-1]), stopReason, versions: [], resumeHandle: "" },
      "s",
    );
  const read = (r: StopReason) => [seq(r).stopReason, seq(r).stoppedBy];
  assert.deepEqual(read(StopReason.STOP), ["stop", "eos"]);
  assert.deepEqual(read(StopReason.STOP_STRING), ["stop", "stop_string"]);
  assert.deepEqual(read(StopReason.STOP_TOKEN), ["stop", "stop_token"]);
  assert.deepEqual(read(StopReason.LENGTH), ["length", undefined]);
  assert.deepEqual(read(StopReason.CANCELLED), ["cancelled", undefined]);
  assert.deepEqual(read(StopReason.PARTIAL), ["partial", undefined]);
  assert.ok(!("stoppedBy" in seq(StopReason.LENGTH)));
  assert.deepEqual(read(99 as StopReason), ["stop", undefined]); // a reason newer than the client
  assert.deepEqual(read(StopReason.STOP_REASON_UNSPECIFIED), ["stop", undefined]);
});

test("every loss of the generated LossFn is sent by its lower-cased name, gspo included", () => {
  const generated = Object.entries(LossFn).filter(([, v]) => typeof v === "number" && v > 0);
  assert.ok(generated.length >= 6);
  for (const [name, value] of generated) assert.equal(convert.lossFnToWire(name.toLowerCase()), value);
  assert.equal(convert.lossFnToWire("gspo"), LossFn.GSPO);
  throwsNaming(() => convert.lossFnToWire("loss_fn_unspecified"), "lossFn");
  throwsNaming(() => convert.lossFnToWire("GSPO"), "lossFn");
  assert.throws(() => convert.lossFnToWire("nope"), /known: cross_entropy, .*gspo/);
});

test("optimStep with no_grad:value = 1 emits a NoGradientWarning", async () => {
  const seen: Error[] = [];
  const listener = (w: Error) => seen.push(w);
  process.on("warning", listener);
  try {
    const quiet = convert.optimStepFromWire({ step: 3, metrics: { "no_grad:value": 0, "grad_norm:value": 1 } }, "m-1");
    const loud = convert.optimStepFromWire({ step: 4, metrics: { "no_grad:value": 1 } }, "m-1");
    await new Promise((r) => setImmediate(r));
    assert.deepEqual(quiet, { step: 3, metrics: { "no_grad:value": 0, "grad_norm:value": 1 } });
    assert.equal(loud.step, 4);
    assert.equal(seen.length, 1);
    assert.equal(seen[0]!.name, "NoGradientWarning");
    assert.match(seen[0]!.message, /m-1.*no gradient/);
  } finally {
    process.off("warning", listener);
  }
});

test("server info carries sampler and training-pass metrics as plain objects", () => {
  const pass = {
    baseModel: "tiny",
    dtype: "float32",
    passes: 10,
    batchedPasses: 2,
    callsBatched: 5,
    callsAlone: 8,
    tokensBatched: 50,
    tokensAlone: 80,
    callsPerBatchedPass: 2.5,
    maxCallsPerPass: 3,
  };
  const info = convert.serverInfoFromWire({
    serverVersion: "0.1.0",
    apiVersion: "treadle.v1",
    baseModels: [],
    maxMessageBytes: 1,
    maxTokensPerRequest: 0,
    features: [],
    samplerMetrics: [],
    trainingPassMetrics: [pass],
    maxModels: 4,
    liveModels: 1,
    workers: [{ workerId: "w1", role: "sampler", status: "live", baseModels: ["tiny"] }],
  });
  assert.deepEqual(info.trainingPassMetrics, [pass]);
  assert.equal(info.maxModels, 4); // the tenant's model quota and its models now
  assert.equal(info.liveModels, 1);
  assert.notEqual(info.trainingPassMetrics[0], pass); // a copy, not the wire message
  assert.deepEqual(info.samplerMetrics, []);
  assert.deepEqual(info.workers, [
    { workerId: "w1", role: "sampler", status: "live", baseModels: ["tiny"] },
  ]);
});

test("a sampler's placement by its name; unset is the server's; another name is refused naming placement", () => {
  assert.equal(convert.samplerPlacementToWire(undefined), SamplerPlacement.SAMPLER_PLACEMENT_UNSPECIFIED);
  assert.equal(convert.samplerPlacementToWire("colocated"), SamplerPlacement.SAMPLER_PLACEMENT_COLOCATED);
  assert.equal(convert.samplerPlacementToWire("pool"), SamplerPlacement.SAMPLER_PLACEMENT_POOL);
  assert.equal(convert.samplerPlacementToWire("auto"), SamplerPlacement.SAMPLER_PLACEMENT_AUTO);
  throwsNaming(() => convert.samplerPlacementToWire("pooled"), "placement");
  throwsNaming(() => convert.samplerPlacementToWire(2), "placement");
});
