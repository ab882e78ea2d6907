/**
 * Public types: plain TypeScript objects, never generated message classes, named as
 * in the Python SDK (camelCase). `src/convert.ts` is the one place they meet the wire.
 *
 * Alignment (as in Python and tinker): a datum's `modelInput` holds the input tokens
 * x[0..T-1]; every per-token array in `lossFnInputs` has length T and refers to the
 * next-token target at that position (`target_tokens[t]` is predicted from x[..t]).
 */
import type { NumericArray } from "./validate.js";

/** Loss names (the proto's LossFn, lower-cased). */
export type LossFnName = "cross_entropy" | "importance_sampling" | "ppo" | "cispo" | "dro";

export type StopReason = "stop" | "length" | "cancelled" | "partial";

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

/** How to sample; unset fields take these defaults (the Python SDK's). */
export interface SamplingParams {
  maxTokens?: number; // 16
  temperature?: number; // 1.0; 0 = greedy
  topP?: number; // 1.0
  topK?: number; // -1 = off
  /** Stop strings, or stop token ids. */
  stop?: string[] | number[];
  seed?: number;
  /** Partial rollouts: at most this many tokens per sequence in this call (0 = none). */
  tokenBudget?: number;
  /** EOS does not stop a sequence (benchmarks, length-controlled rollouts). */
  ignoreEos?: boolean;
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
