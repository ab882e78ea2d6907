/** The five primitives, a sample stream, the tokenizer and a checkpoint round trip,
 * through @treadle/client against a live `treadle serve`. */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import {
  type Datum,
  FailedPreconditionError,
  InvalidArgumentError,
  ServiceClient,
  type TrainingClient,
} from "../src/index.js";
import { TINY, type TestServer, testServer } from "./harness.js";

let server: TestServer;
let service: ServiceClient;

before(async () => {
  server = await testServer();
  service = new ServiceClient({ address: server.address, apiKey: server.apiKey, timeoutS: 120 });
});
after(async () => {
  service.close();
  await server.stop();
});

/** A next-token datum teaching `tokens` (weights on every position). */
function datum(tokens: number[], weight = 1): Datum {
  return {
    modelInput: tokens.slice(0, -1),
    lossFnInputs: { target_tokens: tokens.slice(1), weights: tokens.slice(1).map(() => weight) },
  };
}

describe("primitives", () => {
  let trainer: TrainingClient;
  let data: Datum[];

  before(async () => {
    trainer = await service.createLoraTrainingClient(TINY, { rank: 4, seed: 3 });
    const tok = await service.getTokenizer(TINY);
    data = ["1+2=3", "4+4=8"].map((s) => datum([tok.bosTokenId!, ...tok.encode(s)]));
  });

  test("server info and tokenizer", async () => {
    const info = await service.getServerInfo();
    assert.equal(info.apiVersion, "treadle.v1");
    assert.deepEqual(info.baseModels.map((b) => b.name).sort(), ["demo", "tiny"]);
    const tok = await service.getTokenizer(TINY);
    const ids = tok.encode("7+5=12");
    assert.ok(ids.length > 0 && ids.every(Number.isInteger));
    assert.equal(tok.decode(ids), "7+5=12");
    assert.ok(tok.eosTokenId !== undefined && tok.vocabSize > ids.length);
  });

  test("forwardBackward + optimStep in flight together, then forwardLogprobs", async () => {
    const before = await trainer.forwardLogprobs(data);
    // Both calls are sent before either answers: the seq_ids order them.
    const fb = trainer.forwardBackward(data, "cross_entropy");
    const step = trainer.optimStep({ learningRate: 0.05 });
    const [out, optim] = await Promise.all([fb, step]);
    assert.equal(out.lossFnOutputs.length, 2);
    assert.equal(out.lossFnOutputs[0]!.logprobs.length, data[0]!.modelInput.length);
    assert.ok(out.metrics["loss:sum"]! > 0);
    assert.equal(optim.step, 1);
    // forwardBackward saw the weights before the step.
    assert.deepEqual(out.lossFnOutputs[0]!.logprobs, before.lossFnOutputs[0]!.logprobs);
    const afterStep = await trainer.forwardLogprobs(data);
    const sum = (xs: ArrayLike<number>) => Array.from(xs).reduce((a, b) => a + b, 0);
    assert.ok(sum(afterStep.lossFnOutputs[0]!.logprobs) > sum(before.lossFnOutputs[0]!.logprobs), "the step learned");
    const ref = await trainer.forwardLogprobs(data, { reference: true });
    // LoRA B starts at zero, so the base model's logprobs are the adapter's before any step.
    assert.deepEqual(ref.lossFnOutputs[0]!.logprobs, before.lossFnOutputs[0]!.logprobs);
    assert.notDeepEqual(ref.lossFnOutputs[0]!.logprobs, afterStep.lossFnOutputs[0]!.logprobs);
    const info = await trainer.getInfo();
    assert.equal(info.version, 1);
    assert.equal(info.nextSeqId, 6); // five ordered calls so far
  });

  test("syncWeights -> sample (versions, logprobs) and sampleStream", async () => {
    const sampler = await trainer.syncWeights();
    assert.equal(sampler.version, 1);
    const tok = await service.getTokenizer(TINY);
    const prompt = [tok.bosTokenId!, ...tok.encode("2+3=")];
    const res = await sampler.sample(prompt, 3, { maxTokens: 4, seed: 1 });
    assert.equal(res.sequences.length, 3);
    for (const seq of res.sequences) {
      assert.equal(seq.tokens.length, seq.logprobs.length);
      assert.ok(seq.logprobs.every((lp) => lp <= 0));
      assert.deepEqual(seq.versions, [{ start: 0, length: seq.tokens.length, version: 1 }]);
      assert.ok(["stop", "length"].includes(seq.stopReason));
    }
    // The same seed streams the same samples, each index once.
    const streamed = new Map<number, number[]>();
    for await (const s of sampler.sampleStream(prompt, 3, { maxTokens: 4, seed: 1 })) {
      assert.ok(!streamed.has(s.index));
      streamed.set(s.index, s.sequence.tokens);
    }
    assert.deepEqual([...streamed.keys()].sort(), [0, 1, 2]);
    for (const [i, tokens] of streamed) assert.deepEqual(tokens, res.sequences[i]!.tokens);
  });

  test("a sampler's placement: createSamplingClient and syncWeights on a server without a pool", async () => {
    const other = await service.createLoraTrainingClient(TINY, { rank: 2, seed: 4 });
    const noPool = new RegExp(`no sampler worker serves base model '${TINY}' \\(the sampler's placement pool`);
    // no sampler workers here: "pool" refuses the sync (it takes its seq_id, nothing is published)
    await assert.rejects(other.syncWeights({ placement: "pool" }), (err: Error) => {
      assert.ok(err instanceof FailedPreconditionError, String(err));
      assert.match(err.message, noPool);
      return true;
    });
    // ...and a new sampler asking for it, at once: FAILED_PRECONDITION, never retried
    // (UNAVAILABLE was retried for about 6 s)
    const retried: string[] = [];
    const counting = new ServiceClient({
      address: server.address,
      apiKey: server.apiKey,
      timeoutS: 120,
      onRetry: (err) => retried.push(err.code),
    });
    try {
      for (const target of [{ baseModel: TINY }, { weights: `treadle://${other.modelId}/latest` }]) {
        await assert.rejects(counting.createSamplingClient({ ...target, placement: "pool" }), (err: Error) => {
          assert.ok(err instanceof FailedPreconditionError, String(err));
          assert.match(err.message, noPool);
          return true;
        });
      }
    } finally {
      counting.close();
    }
    assert.deepEqual(retried, []);
    // a name outside the enum is refused here, before the call takes a seq_id
    await assert.rejects(
      other.syncWeights({ placement: "pooled" as never }),
      (err: Error) => err instanceof InvalidArgumentError && /\bplacement: /.test(err.message),
    );
    const sampler = await other.syncWeights({ placement: "colocated" });
    const res = await sampler.sample([1, 5, 9], 1, { maxTokens: 2, seed: 0 });
    assert.deepEqual(res.sequences[0]!.versions, [{ start: 0, length: res.sequences[0]!.tokens.length, version: 0 }]);
    assert.equal((await other.getInfo()).nextSeqId, 3);
  });

  test("checkpoint round trip: saveState, train on, loadState; and a new model from the state", async () => {
    const saved = await trainer.saveState("ckpt-a");
    assert.equal(saved.path, `treadle://${trainer.modelId}/state/ckpt-a`);
    assert.equal(saved.step, 1);
    const atSave = await trainer.forwardLogprobs(data);
    await trainer.forwardBackward(data);
    await trainer.optimStep({ learningRate: 0.05 });
    const moved = await trainer.forwardLogprobs(data);
    assert.notDeepEqual(moved.lossFnOutputs[0]!.logprobs, atSave.lossFnOutputs[0]!.logprobs);
    assert.equal(await trainer.loadState(saved.path), 1);
    const restored = await trainer.forwardLogprobs(data);
    assert.deepEqual(restored.lossFnOutputs.map((o) => o.logprobs), atSave.lossFnOutputs.map((o) => o.logprobs));
    const names = (await trainer.listCheckpoints()).map((c) => c.name);
    assert.ok(names.includes("ckpt-a"), names.join(","));
    const copy = await service.createTrainingClientFromState(saved.path);
    const fromState = await copy.forwardLogprobs(data);
    assert.deepEqual(fromState.lossFnOutputs.map((o) => o.logprobs), atSave.lossFnOutputs.map((o) => o.logprobs));
    await service.deleteModel(copy.modelId);
  });
});
