/**
 * Public types: plain TypeScript objects, never generated message classes, named as
 * in the Python SDK (camelCase). `src/convert.ts` is the one place they meet the wire.
 *
 * Alignment (as in Python and tinker): a datum's `modelInput` holds the input tokens
 * x[0..T-1]; every per-token array in `lossFnInputs` has length T and refers to the
 * next-token target at that position (`target_tokens[t]` is predicted from x[..t]).
 */
import type { StopReason, StoppedBy } from "./enums.js";
import type { NumericArray } from "./validate.js";

/** Loss names and stop reasons come from the generated proto code (`src/enums.ts`). */
export type { LossFnName, SamplerPlacementName, StopReason, StoppedBy } from "./enums.js";

/** One training example. */
export interface Datum {
  /** Input token ids [T]. */
  modelInput: NumericArray;
  /**
   * Per-token loss inputs, each of length T, keyed by their wire names:
   * `target_tokens` (integers), `weights`, `logprobs`, `advantages`, `ref_logprobs`, ...
   * Plain arrays and Float32Arrays travel as float32, Float64Arrays as float64.
   */
  lossFnInputs: Record<string, NumericArray>;
}

/** What a forward pass returns for one datum. */
export interface LossFnOutput {
  /** Per-token logprobs of the targets [T] (float32 for a float32 model). */
  logprobs: Float32Array | Float64Array;
  /** Any other per-datum output the server sent, by name. */
  extra: Record<string, Float32Array | Float64Array | number[]>;
}

export interface ForwardBackwardOutput {
  lossFnOutputs: LossFnOutput[];
  /** Keys "name:reduction", e.g. "loss:sum", "clip_frac:mean". */
  metrics: Record<string, number>;
}

/** AdamW hyper-parameters; unset fields take these defaults (the Python SDK's). */
export interface AdamParams {
  learningRate?: number; // 1e-4
  beta1?: number; // 0.9
  beta2?: number; // 0.95
  eps?: number; // 1e-12
  weightDecay?: number; // 0
  gradClipNorm?: number; // 0 = no clipping
}

export interface OptimStepResponse {
  /** Optimizer steps applied so far (= the new weight version). */
  step: number;
  metrics: Record<string, number>;
}

/**
 * How to sample, as the Python SDK's `SamplingParams`. An undefined knob is left unset
 * on the wire (the server's default), which is never the same as an explicit value:
 *
 * - `temperature`: unset = 1. `0` is greedy: every sample of a request is the argmax
 *   path, and each returned logprob is that token's log_softmax at temperature 1.
 * - `topP`: unset = 1 (off); an explicit value must lie in (0, 1].
 * - `topK`: unset, `0` or `-1` = off; below -1 is refused.
 * - `stop`: a string is ONE stop string (`stop: "</answer>"`); an array holds stop
 *   strings and/or stop token ids. Nothing is cut from the output: the token that
 *   completes a stop string, or the stop token, is the last one returned
 *   (`SampledSequence.stoppedBy` says which stopped it).
 */
export interface SamplingParams {
  maxTokens?: number; // 16
  temperature?: number; // unset = 1; 0 = greedy
  topP?: number; // unset = 1 (off); (0, 1]
  topK?: number; // unset, 0 or -1 = off
  /** One stop string, or an array of stop strings and/or stop token ids. */
  stop?: string | readonly (string | number)[];
  seed?: number;
  /** Partial rollouts: at most this many tokens per sequence in this call (0 = none). */
  tokenBudget?: number;
  /** EOS does not stop a sequence (benchmarks, length-controlled rollouts). */
  ignoreEos?: boolean;
  /**
   * Keep this request's prompt + completion KV on the sampler after it finishes
   * (one sample per request only), so a next request extending them (an agent's
   * next turn) prefills only its new tokens. Costs sampler memory: ask only when
   * such a follow-up is likely.
   */
  cacheCompletion?: boolean;
}

/** Tokens [start, start + length) of a sequence were written by weight `version`. */
export interface VersionSpan {
  start: number;
  length: number;
  version: number;
}

export interface SampledSequence {
  tokens: number[];
  /** Behaviour logprobs, log_softmax(logits / T) before truncation. */
  logprobs: number[];
  stopReason: StopReason;
  /** Set when stopReason is "stop": the EOS token, a stop string or a stop token. */
  stoppedBy?: StoppedBy;
  versions: VersionSpan[];
  /** Set when stopReason is "partial". */
  resumeHandle?: string;
}

export interface SampleResponse {
  sequences: SampledSequence[];
}

/** One sample of `SamplingClient.sampleStream`, yielded the moment it finished. */
export interface StreamedSample {
  /** Its index within the request, 0..numSamples-1. */
  index: number;
  sequence: SampledSequence;
}

export interface ModelInfo {
  modelId: string;
  baseModel: string;
  isLora: boolean;
  loraRank: number;
  dtype: string;
  /** Optimizer steps applied. */
  version: number;
  /** The next seq_id the engine expects. */
  nextSeqId: number;
  lastCheckpointSeqId: number;
  status: string;
  /** Unix seconds. */
  createdAt: number;
  sessionId: string;
  /** The caller's notes on the run, as given at creation (tinker's user_metadata). */
  userMetadata: Record<string, string>;
}

export interface SaveStateResponse {
  /** treadle://<model_id>/state/<name> */
  path: string;
  seqId: number;
  step: number;
}

export interface CheckpointInfo {
  path: string;
  name: string;
  seqId: number;
  step: number;
  createdAt: number;
  sizeBytes: number;
}

export interface BaseModelInfo {
  name: string;
  arch: string;
  vocabSize: number;
  maxContext: number;
  numParams: number;
  dtype: string;
}

export interface ServerInfo {
  serverVersion: string;
  apiVersion: string;
  baseModels: BaseModelInfo[];
  maxMessageBytes: number;
  maxTokensPerRequest: number;
  features: string[];
  /** Live throughput of each sampler (per base model and dtype); empty until one ran. */
  samplerMetrics: SamplerMetrics[];
  /** How training passes were shared between calls (per base model and dtype); empty until one ran. */
  trainingPassMetrics: TrainingPassMetrics[];
  /** The tenant's max_models quota (0: no limit); check it before creating several models. */
  maxModels: number;
  /** The tenant's models that count against maxModels now. */
  liveModels: number;
  /** A distributed server's workers and their roles (empty when the server is embedded). */
  workers: WorkerInfo[];
}

/** A worker of a distributed server (the proto's WorkerInfo). */
export interface WorkerInfo {
  workerId: string;
  /** "both" (trains and samples), "trainer" or "sampler" (`treadle worker --role`). */
  role: string;
  /** "live" or "draining". */
  status: string;
  baseModels: string[];
}

/** A sampler's progress (the proto's SamplerMetrics). */
export interface SamplerMetrics {
  baseModel: string;
  dtype: string;
  /** Generated tokens per second, recent decode steps. */
  tokensPerS: number;
  /** Mean fraction of KV slots decoding per step, recent steps. */
  occupancy: number;
  runningRows: number;
  numSlots: number;
  queuedRequests: number;
  prefillingRequests: number;
  tokensGenerated: number;
  promptTokens: number;
  prefixReusedTokens: number;
}

/** Whether calls of different models shared the base model's training passes, since the
 * engine started (the proto's TrainingPassMetrics). */
export interface TrainingPassMetrics {
  baseModel: string;
  dtype: string;
  /** Forward passes run (a batched pass counts once). */
  passes: number;
  /** Passes that held two or more calls. */
  batchedPasses: number;
  callsBatched: number;
  callsAlone: number;
  tokensBatched: number;
  tokensAlone: number;
  /** callsBatched / batchedPasses (0 when none). */
  callsPerBatchedPass: number;
  maxCallsPerPass: number;
}

/** What a sampler reads. */
export interface SamplerInfo {
  samplerId: string;
  baseModel: string;
  /** The training model whose weights it reads; undefined for a base-model sampler. */
  modelId: string | undefined;
  /** The pinned version; undefined when following `latest`. */
  version: number | undefined;
}
