/** ServiceClient: the entry point, one per server connection. */
import type { ChannelCredentials } from "@grpc/grpc-js";
import * as convert from "./convert.js";
import { InvalidArgumentError, type TreadleError } from "./errors.js";
import type { SamplerPlacementName } from "./enums.js";
import { SamplingServiceClient } from "./gen/treadle/v1/sampling.js";
import { ServerServiceClient, type TokenizerChunk } from "./gen/treadle/v1/server.js";
import { TrainingServiceClient, type CreateModelRequest } from "./gen/treadle/v1/training.js";
import { asTreadleError, Caller, CHANNEL_OPTIONS, channelCredentials } from "./rpc.js";
import { SamplingClient } from "./sampling-client.js";
import { Tokenizer } from "./tokenizer.js";
import { TrainingClient } from "./training-client.js";
import type { ModelInfo, ServerInfo } from "./types.js";
import { describe, integer, nonEmptyString } from "./validate.js";

export const DEFAULT_ADDRESS = "localhost:50051";

export interface ServiceClientOptions {
  /** host:port; default env TREADLE_ADDRESS or localhost:50051. */
  address?: string;
  /** Default env TREADLE_API_KEY. */
  apiKey?: string;
  /** PEM root certificate(s): turns TLS on. */
  rootCertificates?: Buffer | string;
  /** Deadline of each call (each attempt), in seconds; default none. */
  timeoutS?: number;
  /** Retries of UNAVAILABLE (exponential back-off); default 5. */
  maxRetries?: number;
  /** How long in all a call waits out RESOURCE_EXHAUSTED with a retry delay; default 600 s. */
  quotaWaitS?: number;
  /** Told of each retry (UNAVAILABLE, or RESOURCE_EXHAUSTED waited out) before its wait. */
  onRetry?: (error: TreadleError, delayS: number) => void;
}

export interface LoraOptions {
  /** LoRA rank, >= 1; default 32. */
  rank?: number;
  seed?: number;
  /** Default: the rank. */
  alpha?: number;
  /** "float32" | "float64" | "bfloat16"; default the server's. */
  dtype?: string;
  /** Adapt the attention projections q/k/v/o; unset = the server's default (true). */
  trainAttn?: boolean;
  /** Adapt the MLP gate/up/down projections; unset = the server's default (true). */
  trainMlp?: boolean;
  /** Adapt the output head (lm_head); unset = the server's default (true). It matters most
   * on a base whose head is not pretrained (the random-weight presets). */
  trainUnembed?: boolean;
}

/** A LoRA module flag: undefined stays unset on the wire (the server's default, true). */
function flag(value: unknown, field: string): boolean | undefined {
  if (value === undefined || typeof value === "boolean") return value;
  throw new InvalidArgumentError(`${field}: expected a boolean, got ${describe(value)}`);
}

export class ServiceClient {
  readonly address: string;
  private readonly caller: Caller;
  private readonly training: TrainingServiceClient;
  private readonly sampling: SamplingServiceClient;
  private readonly server: ServerServiceClient;
  private readonly tokenizers = new Map<string, Promise<Tokenizer>>();

  constructor(options: ServiceClientOptions = {}) {
    this.address = options.address ?? process.env["TREADLE_ADDRESS"] ?? DEFAULT_ADDRESS;
    if (options.timeoutS !== undefined && !(options.timeoutS > 0)) {
      throw new InvalidArgumentError(`timeoutS: must be > 0 seconds, got ${describe(options.timeoutS)}`);
    }
    this.caller = new Caller(options);
    const creds: ChannelCredentials = channelCredentials(options.rootCertificates);
    // One channel shared by the three service clients.
    this.training = new TrainingServiceClient(this.address, creds, CHANNEL_OPTIONS);
    const channelOverride = this.training.getChannel();
    this.sampling = new SamplingServiceClient(this.address, creds, { channelOverride });
    this.server = new ServerServiceClient(this.address, creds, { channelOverride });
  }

  // ---- training clients ---------------------------------------------------------------

  /**
   * A new LoRA model on `baseModel`: an adapter of `rank` (scale alpha / rank) on the
   * modules the flags name, as in the tinker SDK (`trainMlp`, `trainAttn`,
   * `trainUnembed`, each unset = true); resolves once the server created it.
   */
  createLoraTrainingClient(baseModel: string, options: LoraOptions = {}): Promise<TrainingClient> {
    try {
      const rank = integer(options.rank ?? 32, "rank", { min: 1 });
      const trainAttn = flag(options.trainAttn, "trainAttn");
      const trainMlp = flag(options.trainMlp, "trainMlp");
      const trainUnembed = flag(options.trainUnembed, "trainUnembed");
      if (trainAttn === false && trainMlp === false && trainUnembed === false) {
        throw new InvalidArgumentError(
          "trainMlp, trainAttn, trainUnembed: at least one must be true (all false leaves the adapter nothing to train)",
        );
      }
      return this.create({
        baseModel: nonEmptyString(baseModel, "baseModel"),
        loraRank: rank,
        loraAlpha: options.alpha ?? 0,
        seed: integer(options.seed ?? 0, "seed"),
        dtype: options.dtype ?? "",
        trainAttn,
        trainMlp,
        trainUnembed,
      });
    } catch (err) {
      return Promise.reject(err);
    }
  }

  /** A full fine-tune: every weight trains (and every published version is a copy). */
  createTrainingClient(baseModel: string, options: { seed?: number; dtype?: string } = {}): Promise<TrainingClient> {
    try {
      return this.create({
        baseModel: nonEmptyString(baseModel, "baseModel"),
        loraRank: 0,
        seed: integer(options.seed ?? 0, "seed"),
        dtype: options.dtype ?? "",
      });
    } catch (err) {
      return Promise.reject(err);
    }
  }

  /** A new model initialised from a treadle:// checkpoint (weights, optimizer state, step;
   * with `weightsOnly`, fresh Adam moments). */
  createTrainingClientFromState(path: string, opts: { weightsOnly?: boolean } = {}): Promise<TrainingClient> {
    try {
      return this.create({ fromState: nonEmptyString(path, "path"), weightsOnly: opts.weightsOnly ?? false });
    } catch (err) {
      return Promise.reject(err);
    }
  }

  /** Reattach to an existing model (continues at the server's next seq_id). */
  async getTrainingClient(modelId: string): Promise<TrainingClient> {
    return new TrainingClient(this.training, this.sampling, this.caller, await this.getModelInfo(modelId));
  }

  getModelInfo(modelId: string): Promise<ModelInfo> {
    return this.caller.call(this.training.getModelInfo.bind(this.training), { modelId }, convert.modelInfoFromWire);
  }

  listModels(): Promise<ModelInfo[]> {
    return this.caller.call(this.training.listModels.bind(this.training), {}, (r) =>
      r.models.map(convert.modelInfoFromWire),
    );
  }

  deleteModel(modelId: string): Promise<void> {
    return this.caller.call(this.training.deleteModel.bind(this.training), { modelId }, () => undefined);
  }

  private async create(fields: Partial<CreateModelRequest>): Promise<TrainingClient> {
    const request: CreateModelRequest = {
      baseModel: "",
      loraRank: 0,
      loraAlpha: 0,
      seed: 0,
      dtype: "",
      fromState: "",
      sessionId: "",
      weightsOnly: false,
      userMetadata: {},
      ...fields,
    };
    const info = await this.caller.call(this.training.createModel.bind(this.training), request, convert.modelInfoFromWire);
    return new TrainingClient(this.training, this.sampling, this.caller, info);
  }

  // ---- sampling -----------------------------------------------------------------------

  /**
   * A sampler on a base model (`{baseModel}`), or on `{weights}`: a
   * treadle://<model_id>/v/<version> path (pinned) or treadle://<model_id>/latest
   * (follows every syncWeights). `placement` (a distributed server): "colocated" on
   * the model's worker, "pool" on the sampler workers of its base (with none:
   * FailedPreconditionError naming the base, at once, not retried; a sampler whose
   * pool workers are gone later rejects a sample with UnavailableError), "auto" the
   * pool when there is one; unset: the server's `--sampler-placement`.
   */
  async createSamplingClient(
    target: ({ baseModel: string } | { weights: string }) & { placement?: SamplerPlacementName },
  ): Promise<SamplingClient> {
    const t = (target ?? {}) as { baseModel?: unknown; weights?: unknown; placement?: unknown };
    if ((t.baseModel === undefined) === (t.weights === undefined)) {
      throw new InvalidArgumentError("createSamplingClient: give exactly one of baseModel or weights");
    }
    const placement = convert.samplerPlacementToWire(t.placement);
    const request =
      t.baseModel !== undefined
        ? { baseModel: nonEmptyString(t.baseModel, "baseModel"), placement }
        : { weights: nonEmptyString(t.weights, "weights"), placement };
    const info = await this.caller.call(this.sampling.createSampler.bind(this.sampling), request, (r) => ({
      samplerId: r.samplerId,
      baseModel: r.baseModel,
      modelId: r.modelId || undefined,
      version: r.followsLatest ? undefined : r.version,
    }));
    return new SamplingClient(this.sampling, this.caller, info);
  }

  // ---- server -------------------------------------------------------------------------

  getServerInfo(): Promise<ServerInfo> {
    return this.caller.call(this.server.getServerInfo.bind(this.server), {}, convert.serverInfoFromWire);
  }

  /** The base model's tokenizer, streamed from the server once per client (`GetTokenizer`). */
  getTokenizer(baseModel: string): Promise<Tokenizer> {
    let tok = this.tokenizers.get(baseModel);
    if (tok === undefined) {
      tok = this.downloadTokenizer(baseModel);
      tok.catch(() => this.tokenizers.delete(baseModel)); // a failure is not cached
      this.tokenizers.set(baseModel, tok);
    }
    return tok;
  }

  private async downloadTokenizer(baseModel: string): Promise<Tokenizer> {
    const parts = new Map<string, Buffer[]>();
    const stream = this.server.getTokenizer({ baseModel }, this.caller.metadata(), this.caller.callOptions());
    try {
      for await (const raw of stream) {
        const chunk = raw as TokenizerChunk;
        const name = chunk.fileName.split("/").pop() ?? chunk.fileName;
        const list = parts.get(name) ?? [];
        list.push(chunk.data);
        parts.set(name, list);
      }
    } catch (err) {
      throw asTreadleError(err);
    }
    return new Tokenizer(new Map([...parts].map(([name, bufs]) => [name, Buffer.concat(bufs)])));
  }

  /** Close the connection (calls in flight fail with CANCELLED). */
  close(): void {
    this.training.close();
    this.sampling.close();
    this.server.close();
  }
}
