/**
 * Typed errors: the tenant wall (another tenant's model id is NOT_FOUND), bad input
 * rejected before sending with the field named, the server's rejections as the same
 * classes with the server's message, the class names and codes equal to the Python
 * hierarchy's, and RESOURCE_EXHAUSTED with a retry delay waited out.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { after, before, describe, test } from "node:test";
import {
  type Datum,
  ERRORS_BY_CODE,
  InvalidArgumentError,
  NotFoundError,
  DeadlineExceededError,
  ResourceExhaustedError,
  ServiceClient,
  type TrainingClient,
  TreadleError,
  UnauthenticatedError,
} from "../src/index.js";
import { admin, PYTHON, TINY, type TestServer, testServer } from "./harness.js";

let server: TestServer;
let service: ServiceClient;
let trainer: TrainingClient;
const good: Datum = { modelInput: [1, 5, 6], lossFnInputs: { target_tokens: [5, 6, 7], weights: [1, 1, 1] } };

before(async () => {
  server = await testServer();
  service = new ServiceClient({ address: server.address, apiKey: server.apiKey });
  trainer = await service.createLoraTrainingClient(TINY, { rank: 2 });
});
after(async () => {
  service.close();
  await server.stop();
});

/** Assert `promise` rejects with `cls` whose message names `field`. */
async function rejectsNaming(promise: Promise<unknown>, cls: typeof TreadleError, field: string): Promise<TreadleError> {
  const err = await promise.then(
    () => assert.fail(`expected ${cls.name} naming ${field}`),
    (e: unknown) => e,
  );
  assert.ok(err instanceof cls, `${String(err)} is not a ${cls.name}`);
  assert.ok((err as TreadleError).details.includes(field), `"${(err as TreadleError).details}" does not name ${field}`);
  return err as TreadleError;
}

describe("the tenant wall", () => {
  test("another tenant's model id answers NOT_FOUND, like an unknown id", async () => {
    const otherKey = admin(server, "create-tenant", `other-${process.pid}`);
    const other = new ServiceClient({ address: server.address, apiKey: otherKey });
    try {
      const mine = await other.createLoraTrainingClient(TINY, { rank: 2 });
      assert.deepEqual((await other.listModels()).map((m) => m.modelId), [mine.modelId]);
      const foreign = await other.getModelInfo(trainer.modelId).then(
        () => assert.fail("another tenant's model was visible"),
        (e: unknown) => e,
      );
      assert.ok(foreign instanceof NotFoundError, String(foreign));
      assert.equal((foreign as NotFoundError).code, "NOT_FOUND");
      await assert.rejects(other.getModelInfo("no-such-model"), NotFoundError);
      await assert.rejects(other.createSamplingClient({ weights: `treadle://${trainer.modelId}/latest` }), NotFoundError);
    } finally {
      other.close();
    }
  });

  test("a wrong key is UNAUTHENTICATED", async () => {
    const stranger = new ServiceClient({ address: server.address, apiKey: "tdl-not-a-key" });
    try {
      await assert.rejects(stranger.listModels(), UnauthenticatedError);
    } finally {
      stranger.close();
    }
  });
});

describe("bad input", () => {
  test("checked before sending, naming the field, and using no seq_id", async () => {
    const next = (await trainer.getInfo()).nextSeqId;
    await rejectsNaming(
      trainer.forwardBackward([good, { modelInput: [1, 2.5, 3], lossFnInputs: {} }]),
      InvalidArgumentError,
      "data[1].modelInput[1]",
    );
    await rejectsNaming(
      trainer.forwardBackward([{ ...good, lossFnInputs: { ...good.lossFnInputs, weights: [1, 1] } }]),
      InvalidArgumentError,
      "data[0].lossFnInputs.weights",
    );
    await rejectsNaming(
      trainer.forwardBackward([{ ...good, lossFnInputs: { ...good.lossFnInputs, target_tokens: [5, -1, 7] } }]),
      InvalidArgumentError,
      "data[0].lossFnInputs.target_tokens[1]",
    );
    await rejectsNaming(
      trainer.forwardBackward([good], "nope" as never),
      InvalidArgumentError,
      "lossFn",
    );
    await rejectsNaming(trainer.optimStep({ learningRate: Number.NaN }), InvalidArgumentError, "adamParams.learningRate");
    await rejectsNaming(trainer.forwardBackward("abc" as never), InvalidArgumentError, "data");
    const sampler = await service.createSamplingClient({ baseModel: TINY });
    await rejectsNaming(sampler.sample([1, 2], 0), InvalidArgumentError, "numSamples");
    await rejectsNaming(sampler.sample(["a"] as never), InvalidArgumentError, "prompt[0]");
    await rejectsNaming(sampler.sample([1, 2], 1, { maxTokens: 1.5 }), InvalidArgumentError, "samplingParams.maxTokens");
    // None of these took a seq_id: the model's next call is still the next one.
    assert.equal((await trainer.getInfo()).nextSeqId, next);
    await trainer.forwardLogprobs([good]);
    assert.equal((await trainer.getInfo()).nextSeqId, next + 1);
  });

  test("what only the server can check comes back typed, with the server's message", async () => {
    const sampler = await service.createSamplingClient({ baseModel: TINY });
    const err = await rejectsNaming(sampler.sample([1, 999_999], 1), InvalidArgumentError, "prompt");
    assert.match(err.details, /outside the vocabulary/);
    assert.equal(err.code, "INVALID_ARGUMENT");
    assert.equal(err.name, "InvalidArgumentError");
    const dtype = await rejectsNaming(
      service.createLoraTrainingClient(TINY, { rank: 2, dtype: "float8" }),
      InvalidArgumentError,
      "dtype",
    );
    assert.match(dtype.details, /choose from/);
    await rejectsNaming(service.createLoraTrainingClient("no-such-base", { rank: 2 }), NotFoundError, "base_model");
    await assert.rejects(trainer.loadState(`treadle://${trainer.modelId}/state/never-saved`), NotFoundError);
  });
});

test("the error classes have the Python hierarchy's names and codes", () => {
  const py = spawnSync(
    PYTHON,
    ["-c", "import json, treadle.errors as e; print(json.dumps({c: k.__name__ for c, k in e.ERRORS_BY_CODE.items()}))"],
    { encoding: "utf8" },
  );
  assert.equal(py.status, 0, py.stderr);
  const python = JSON.parse(py.stdout) as Record<string, string>;
  const node = Object.fromEntries(Object.entries(ERRORS_BY_CODE).map(([code, cls]) => [code, cls.name]));
  assert.deepEqual(node, python);
  for (const [code, cls] of Object.entries(ERRORS_BY_CODE)) {
    const err = new cls("x");
    assert.ok(err instanceof TreadleError && err instanceof Error);
    assert.equal(err.code, code);
  }
});

test("RESOURCE_EXHAUSTED with a retry delay is waited out", async () => {
  const tenant = `tight-${process.pid}`;
  const key = admin(server, "create-tenant", tenant);
  admin(server, "set-quota", tenant, "--max-calls-in-flight", "1");
  const refusals: ResourceExhaustedError[] = [];
  const tight = new ServiceClient({
    address: server.address,
    apiKey: key,
    onRetry: (err) => {
      if (err instanceof ResourceExhaustedError) refusals.push(err);
    },
  });
  try {
    const sampler = await tight.createSamplingClient({ baseModel: TINY });
    // Four calls at once against a quota of one call in flight: the server refuses
    // some with a retry delay, the client waits each out, and all four succeed.
    const results = await Promise.all(
      [1, 2, 3, 4].map((seed) => sampler.sample([1, 5, 6], 2, { maxTokens: 8, seed, ignoreEos: true })),
    );
    assert.ok(results.every((r) => r.sequences.length === 2 && r.sequences[0]!.tokens.length === 8));
    assert.ok(refusals.length > 0, "the quota never refused a call");
    assert.ok(refusals.every((e) => e.retryAfterS !== undefined && e.retryAfterS > 0));
  } finally {
    tight.close();
  }
});

test("a deadline too short for the call is DEADLINE_EXCEEDED", async () => {
  // 1 ms: less than any round trip through auth and the database here (2+ ms).
  const hasty = new ServiceClient({ address: server.address, apiKey: server.apiKey, timeoutS: 0.001 });
  try {
    await assert.rejects(hasty.listModels(), DeadlineExceededError);
    await assert.rejects(hasty.createSamplingClient({ baseModel: TINY }), DeadlineExceededError);
  } finally {
    hasty.close();
  }
});
