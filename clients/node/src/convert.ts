/**
 * Public types <-> wire messages: with `src/enums.ts` (the enums' public names), the
 * one place the client touches generated code (src/gen, from protos/ by ts-proto).
 * Tensors are packed little-endian, as `treadle.wire.tensors` packs them: token ids as int64, per-token values as float32
 * (float64 when given a Float64Array).
 */
import {
  LOSS_FNS,
  type LossFnName,
  SAMPLER_PLACEMENTS,
  type SamplerPlacementName,
  stopReasonFromWire,
} from "./enums.js";
import { InvalidArgumentError } from "./errors.js";
import * as common from "./gen/treadle/v1/common.js";
import * as samplingPb from "./gen/treadle/v1/sampling.js";
import * as serverPb from "./gen/treadle/v1/server.js";
import * as trainingPb from "./gen/treadle/v1/training.js";
import type {
  AdamParams,
  CheckpointInfo,
  Datum,
  ForwardBackwardOutput,
  ModelInfo,
  OptimStepResponse,
  SampledSequence,
  SampleResponse,
  SamplingParams,
  ServerInfo,
  StreamedSample,
} from "./types.js";
import {
  describe,
  finite,
  finiteNumbers,
  integer,
  isNumericArray,
  type NumericArray,
  tokenIds,
} from "./validate.js";

/** loss_fn_inputs keys holding integer tokens; every other key is float. */
const INT_INPUT_KEYS = new Set(["target_tokens"]);

// ---- tensors ------------------------------------------------------------------------

export function int64Tensor(values: readonly number[]): common.Tensor {
  const buf = Buffer.allocUnsafe(values.length * 8);
  for (let i = 0; i < values.length; i++) buf.writeBigInt64LE(BigInt(values[i]!), i * 8);
  return { data: buf, dtype: common.DType.INT64, shape: [values.length] };
}

export function floatTensor(values: NumericArray): common.Tensor {
  const f64 = values instanceof Float64Array;
  const size = f64 ? 8 : 4;
  const buf = Buffer.allocUnsafe(values.length * size);
  for (let i = 0; i < values.length; i++) {
    if (f64) buf.writeDoubleLE(values[i]!, i * 8);
    else buf.writeFloatLE(values[i]!, i * 4);
  }
  return { data: buf, dtype: f64 ? common.DType.FLOAT64 : common.DType.FLOAT32, shape: [values.length] };
}

/** Decode a wire tensor (flattened); `field` names it if it is malformed. */
export function fromTensor(t: common.Tensor | undefined, field: string): Float32Array | Float64Array | number[] {
  if (t === undefined) throw new InvalidArgumentError(`${field}: missing`);
  const data = t.data;
  const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
  const whole = (size: number, name: string): number => {
    if (data.byteLength % size !== 0) {
      throw new InvalidArgumentError(`${field}: ${data.byteLength} bytes is not a whole number of ${name}`);
    }
    return data.byteLength / size;
  };
  switch (t.dtype) {
    case common.DType.FLOAT32: {
      const n = whole(4, "float32");
      const out = new Float32Array(n);
      for (let i = 0; i < n; i++) out[i] = view.getFloat32(i * 4, true);
      return out;
    }
    case common.DType.FLOAT64: {
      const n = whole(8, "float64");
      const out = new Float64Array(n);
      for (let i = 0; i < n; i++) out[i] = view.getFloat64(i * 8, true);
      return out;
    }
    case common.DType.BFLOAT16: {
      const n = whole(2, "bfloat16");
      const out = new Float32Array(n);
      const bits = new DataView(new ArrayBuffer(4));
      for (let i = 0; i < n; i++) {
        bits.setUint32(0, view.getUint16(i * 2, true) << 16);
        out[i] = bits.getFloat32(0);
      }
      return out;
    }
    case common.DType.INT64: {
      const n = whole(8, "int64");
      return Array.from({ length: n }, (_, i) => Number(view.getBigInt64(i * 8, true)));
    }
    case common.DType.INT32: {
      const n = whole(4, "int32");
      return Array.from({ length: n }, (_, i) => view.getInt32(i * 4, true));
    }
    default:
      throw new InvalidArgumentError(`${field}: unsupported or missing dtype ${t.dtype}`);
  }
}

function floats(t: common.Tensor | undefined, field: string): Float32Array | Float64Array {
  const arr = fromTensor(t, field);
  return Array.isArray(arr) ? Float64Array.from(arr) : arr;
}

/** A sampler's placement (`createSamplingClient`); undefined: the server's choice. */
export function samplerPlacementToWire(name: unknown): samplingPb.SamplerPlacement {
  if (name === undefined) return samplingPb.SamplerPlacement.SAMPLER_PLACEMENT_UNSPECIFIED;
  const value = typeof name === "string" ? SAMPLER_PLACEMENTS.get(name as SamplerPlacementName) : undefined;
  if (value === undefined) {
    throw new InvalidArgumentError(
      `placement: unknown placement ${describe(name)}; known: ${[...SAMPLER_PLACEMENTS.keys()].join(", ")}`,
    );
  }
  return value;
}

// ---- training -----------------------------------------------------------------------

export function lossFnToWire(name: unknown): common.LossFn {
  const value = typeof name === "string" ? LOSS_FNS.get(name as LossFnName) : undefined;
  if (value === undefined) {
    throw new InvalidArgumentError(
      `lossFn: unknown loss ${describe(name)}; known: ${[...LOSS_FNS.keys()].join(", ")}`,
    );
  }
  return value;
}

/** Check and pack a batch; errors name the datum and field, e.g. `data[2].lossFnInputs.weights`. */
export function datumsToWire(data: unknown): common.Datum[] {
  if (!Array.isArray(data)) {
    throw new InvalidArgumentError(`data: expected an array of datums, got ${describe(data)}`);
  }
  if (data.length === 0) throw new InvalidArgumentError("data: empty batch");
  return data.map((datum: unknown, i) => {
    const name = `data[${i}]`;
    if (typeof datum !== "object" || datum === null) {
      throw new InvalidArgumentError(`${name}: expected a datum {modelInput, lossFnInputs}, got ${describe(datum)}`);
    }
    const d = datum as Partial<Datum>;
    const tokens = tokenIds(d.modelInput, `${name}.modelInput`, { nonEmpty: true });
    const inputs = d.lossFnInputs ?? {};
    if (typeof inputs !== "object" || inputs === null || isNumericArray(inputs)) {
      throw new InvalidArgumentError(`${name}.lossFnInputs: expected an object of arrays, got ${describe(inputs)}`);
    }
    const lossFnInputs: Record<string, common.Tensor> = {};
    for (const [key, value] of Object.entries(inputs)) {
      const field = `${name}.lossFnInputs.${key}`;
      const arr = INT_INPUT_KEYS.has(key) ? tokenIds(value, field) : finiteNumbers(value, field);
      if (arr.length !== tokens.length) {
        throw new InvalidArgumentError(
          `${field}: ${arr.length} values for ${tokens.length} input tokens (one per position of modelInput)`,
        );
      }
      lossFnInputs[key] = INT_INPUT_KEYS.has(key) ? int64Tensor(arr as number[]) : floatTensor(arr);
    }
    return { modelInput: int64Tensor(tokens), lossFnInputs };
  });
}

export function forwardOutputFromWire(msg: trainingPb.ForwardOutput): ForwardBackwardOutput {
  return {
    lossFnOutputs: msg.outputs.map((out, i) => {
      const extra: Record<string, Float32Array | Float64Array | number[]> = {};
      for (const [k, v] of Object.entries(out.outputs)) {
        if (k !== "logprobs") extra[k] = fromTensor(v, `outputs[${i}].${k}`);
      }
      return { logprobs: floats(out.outputs["logprobs"], `outputs[${i}].logprobs`), extra };
    }),
    metrics: { ...msg.metrics },
  };
}

export function temperatureToWire(value: unknown, field = "temperature"): number {
  return finite(value ?? 1.0, field, { min: 0 });
}

export function lossConfigToWire(config: unknown): Record<string, number> {
  if (config === undefined || config === null) return {};
  if (typeof config !== "object" || Array.isArray(config)) {
    throw new InvalidArgumentError(`lossFnConfig: expected an object of numbers, got ${describe(config)}`);
  }
  const out: Record<string, number> = {};
  for (const [k, v] of Object.entries(config)) out[k] = finite(v, `lossFnConfig.${k}`);
  return out;
}

export function adamToWire(params: AdamParams | undefined): trainingPb.AdamParams {
  const p = params ?? {};
  if (typeof p !== "object") throw new InvalidArgumentError(`adamParams: expected an object, got ${describe(p)}`);
  return {
    learningRate: finite(p.learningRate ?? 1e-4, "adamParams.learningRate", { min: 0 }),
    beta1: finite(p.beta1 ?? 0.9, "adamParams.beta1", { min: 0 }),
    beta2: finite(p.beta2 ?? 0.95, "adamParams.beta2", { min: 0 }),
    eps: finite(p.eps ?? 1e-12, "adamParams.eps", { min: 0 }),
    weightDecay: finite(p.weightDecay ?? 0, "adamParams.weightDecay", { min: 0 }),
    gradClipNorm: finite(p.gradClipNorm ?? 0, "adamParams.gradClipNorm", { min: 0 }),
  };
}

/** The step's result; warns (`NoGradientWarning`, as the Python SDK) when the step had
 * no gradient to learn from (the server's `no_grad:value` metric), since Adam's
 * momentum still moved the weights. */
export function optimStepFromWire(msg: trainingPb.OptimStepResponse, modelId: string): OptimStepResponse {
  const metrics = { ...msg.metrics };
  if ((metrics["no_grad:value"] ?? 0) > 0) {
    process.emitWarning(
      `optimStep on model ${modelId}: no gradient since the previous optimStep (grad_norm 0: no ` +
        "forwardBackward in between, or every token had weight or advantage 0), yet Adam's momentum " +
        "moved the weights (see update_norm:value). Skip optimStep when a batch has nothing to learn.",
      "NoGradientWarning",
    );
  }
  return { step: msg.step, metrics };
}

export function modelInfoFromWire(msg: trainingPb.ModelInfo): ModelInfo {
  return {
    modelId: msg.modelId,
    baseModel: msg.baseModel,
    isLora: msg.isLora,
    loraRank: msg.loraRank,
    dtype: msg.dtype,
    version: msg.version,
    nextSeqId: msg.nextSeqId,
    lastCheckpointSeqId: msg.lastCheckpointSeqId,
    status: msg.status,
    createdAt: msg.createdAt,
    sessionId: msg.sessionId,
    userMetadata: { ...msg.userMetadata },
  };
}

export function checkpointFromWire(msg: trainingPb.Checkpoint): CheckpointInfo {
  return {
    path: msg.path,
    name: msg.name,
    seqId: msg.seqId,
    step: msg.step,
    createdAt: msg.createdAt,
    sizeBytes: msg.sizeBytes,
  };
}

// ---- sampling -----------------------------------------------------------------------

/**
 * Unset knobs stay unset on the wire (the server's default); an explicit value, 0
 * included, is sent as it is, after the checks the server would make.
 */
export function samplingParamsToWire(params: SamplingParams | undefined): samplingPb.SamplingParams {
  const p = params ?? {};
  if (typeof p !== "object") throw new InvalidArgumentError(`samplingParams: expected an object, got ${describe(p)}`);
  const [stop, stopTokenIds] = stopsToWire(p.stop);
  const msg: samplingPb.SamplingParams = {
    maxTokens: integer(p.maxTokens ?? 16, "samplingParams.maxTokens", { min: 0, max: 2 ** 31 - 1 }),
    stop,
    stopTokenIds,
    tokenBudget: integer(p.tokenBudget ?? 0, "samplingParams.tokenBudget", { min: 0, max: 2 ** 31 - 1 }),
    ignoreEos: Boolean(p.ignoreEos),
    cacheCompletion: Boolean(p.cacheCompletion),
  };
  if (p.temperature !== undefined) msg.temperature = finite(p.temperature, "samplingParams.temperature", { min: 0 });
  if (p.topP !== undefined) {
    if (typeof p.topP !== "number" || !(p.topP > 0 && p.topP <= 1)) {
      throw new InvalidArgumentError(
        `samplingParams.topP: must be in (0, 1], got ${describe(p.topP)}; leave it unset (or 1) for no nucleus truncation`,
      );
    }
    msg.topP = p.topP;
  }
  if (p.topK !== undefined) msg.topK = integer(p.topK, "samplingParams.topK", { min: -1, max: 2 ** 31 - 1 });
  if (p.seed !== undefined) msg.seed = integer(p.seed, "samplingParams.seed");
  return msg;
}

/** `stop` as [stop strings, stop token ids]. A string is ONE stop string, never its
 * characters (the Python SDK's, tinker's and vLLM's reading). */
export function stopsToWire(stop: unknown): [string[], number[]] {
  if (stop === undefined || stop === null) return [[], []];
  if (typeof stop === "string") return [[stop], []];
  if (!Array.isArray(stop)) {
    throw new InvalidArgumentError(
      `samplingParams.stop: expected a string, or an array of strings and/or token ids, got ${describe(stop)}`,
    );
  }
  const strings: string[] = [];
  const tokenIds: number[] = [];
  (stop as unknown[]).forEach((s, i) => {
    if (typeof s === "string") strings.push(s);
    else if (typeof s === "number") tokenIds.push(integer(s, `samplingParams.stop[${i}]`, { min: 0 }));
    else throw new InvalidArgumentError(`samplingParams.stop[${i}]: expected a stop string or a token id, got ${describe(s)}`);
  });
  return [strings, tokenIds];
}

export function promptToWire(prompt: unknown): common.Tensor {
  return int64Tensor(tokenIds(prompt, "prompt", { nonEmpty: true }));
}

export function sequenceFromWire(seq: samplingPb.SampledSequence | undefined, name: string): SampledSequence {
  if (seq === undefined) throw new InvalidArgumentError(`${name}: missing`);
  // a reason newer than this client still reads as a stop
  const [stopReason, stoppedBy] = stopReasonFromWire(seq.stopReason);
  const out: SampledSequence = {
    tokens: Array.from(fromTensor(seq.tokens, `${name}.tokens`)),
    logprobs: Array.from(fromTensor(seq.logprobs, `${name}.logprobs`)),
    stopReason,
    versions: seq.versions.map((v) => ({ start: v.start, length: v.length, version: v.version })),
  };
  if (stoppedBy !== undefined) out.stoppedBy = stoppedBy;
  if (seq.resumeHandle) out.resumeHandle = seq.resumeHandle;
  return out;
}

export function sampleResponseFromWire(msg: samplingPb.SampleResponse): SampleResponse {
  return { sequences: msg.sequences.map((s, i) => sequenceFromWire(s, `sequences[${i}]`)) };
}

export function streamedSampleFromWire(msg: samplingPb.SampleStreamResponse): StreamedSample {
  return { index: msg.index, sequence: sequenceFromWire(msg.sequence, "sequence") };
}

// ---- server -------------------------------------------------------------------------

export function serverInfoFromWire(msg: serverPb.ServerInfo): ServerInfo {
  return {
    serverVersion: msg.serverVersion,
    apiVersion: msg.apiVersion,
    baseModels: msg.baseModels.map((b) => ({
      name: b.name,
      arch: b.arch,
      vocabSize: b.vocabSize,
      maxContext: b.maxContext,
      numParams: b.numParams,
      dtype: b.dtype,
    })),
    maxMessageBytes: msg.maxMessageBytes,
    maxTokensPerRequest: msg.maxTokensPerRequest,
    maxModels: msg.maxModels,
    liveModels: msg.liveModels,
    workers: msg.workers.map((w) => ({
      workerId: w.workerId,
      role: w.role,
      status: w.status,
      baseModels: [...w.baseModels],
    })),
    features: [...msg.features],
    samplerMetrics: msg.samplerMetrics.map((m) => ({
      baseModel: m.baseModel,
      dtype: m.dtype,
      tokensPerS: m.tokensPerS,
      occupancy: m.occupancy,
      runningRows: m.runningRows,
      numSlots: m.numSlots,
      queuedRequests: m.queuedRequests,
      prefillingRequests: m.prefillingRequests,
      tokensGenerated: m.tokensGenerated,
      promptTokens: m.promptTokens,
      prefixReusedTokens: m.prefixReusedTokens,
    })),
    trainingPassMetrics: msg.trainingPassMetrics.map((p) => ({
      baseModel: p.baseModel,
      dtype: p.dtype,
      passes: p.passes,
      batchedPasses: p.batchedPasses,
      callsBatched: p.callsBatched,
      callsAlone: p.callsAlone,
      tokensBatched: p.tokensBatched,
      tokensAlone: p.tokensAlone,
      callsPerBatchedPass: p.callsPerBatchedPass,
      maxCallsPerPass: p.maxCallsPerPass,
    })),
  };
}
