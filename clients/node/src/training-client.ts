/**
 * TrainingClient: the ordered training primitives of one model.
 *
 * Every call takes the model's next seq_id when it is made and is sent at once;
 * the engine applies calls in seq_id order, so a `forwardBackward` and its
 * `optimStep` travel together (both in flight, no round trip between them) and a
 * retried call is applied once. The seq_id is taken synchronously, before the
 * returned Promise settles: the order of the calls in your code is their order.
 */
import * as convert from "./convert.js";
import type { TrainingServiceClient } from "./gen/treadle/v1/training.js";
import type { SamplingServiceClient } from "./gen/treadle/v1/sampling.js";
import type { SamplerPlacementName } from "./enums.js";
import type { Caller } from "./rpc.js";
import { SamplingClient } from "./sampling-client.js";
import type {
  AdamParams,
  CheckpointInfo,
  Datum,
  ForwardBackwardOutput,
  LossFnName,
  ModelInfo,
  OptimStepResponse,
  SaveStateResponse,
} from "./types.js";
import { InvalidArgumentError } from "./errors.js";
import { describe, nonEmptyString } from "./validate.js";

export interface ForwardBackwardOptions {
  /** Loss knobs, e.g. {clip_low_threshold: 0.8, clip_high_threshold: 1.28} (docs/losses.md). */
  lossFnConfig?: Record<string, number>;
  /** The policy's temperature (default 1), as in sampling. */
  temperature?: number;
}

export interface ForwardLogprobsOptions {
  /** `true`: the base model; a treadle:// state or version path: those weights; default the model itself. */
  reference?: boolean | string;
  /** The policy's temperature (default 1), as in sampling. */
  temperature?: number;
}

/** `reference` as the wire's [reference, reference_path] (the Python SDK's reading). */
function referenceToWire(reference: unknown): [boolean, string] {
  if (reference === undefined || typeof reference === "boolean") return [Boolean(reference), ""];
  if (typeof reference === "string" && reference.length > 0) return [false, reference];
  throw new InvalidArgumentError(
    `reference: expected true (the base model), false (the model itself) or a treadle:// state or version path, got ${describe(reference)}`,
  );
}

export class TrainingClient {
  readonly modelId: string;
  readonly baseModel: string;
  private nextSeq: number;

  constructor(
    private readonly stub: TrainingServiceClient,
    private readonly sampling: SamplingServiceClient,
    private readonly caller: Caller,
    info: ModelInfo,
  ) {
    this.modelId = info.modelId;
    this.baseModel = info.baseModel;
    this.nextSeq = info.nextSeqId;
  }

  private takeSeq(): number {
    return this.nextSeq++;
  }

  /** Continue from the server's next expected seq_id (after a restart brought the
   * model back to its last checkpoint). */
  async resync(): Promise<number> {
    const info = await this.getInfo();
    this.nextSeq = info.nextSeqId;
    return info.nextSeqId;
  }

  /** Accumulate the gradient of sum(loss) over `data` (no hidden mean; normalise in the weights). */
  forwardBackward(
    data: readonly Datum[],
    lossFn: LossFnName = "cross_entropy",
    options: ForwardBackwardOptions = {},
  ): Promise<ForwardBackwardOutput> {
    return this.ordered(() => ({
      request: {
        modelId: this.modelId,
        seqId: 0,
        data: convert.datumsToWire(data),
        lossFn: convert.lossFnToWire(lossFn),
        lossFnConfig: convert.lossConfigToWire(options.lossFnConfig),
        temperature: convert.temperatureToWire(options.temperature),
      },
      send: (req) => this.caller.call(this.stub.forwardBackward.bind(this.stub), req, convert.forwardOutputFromWire),
    }));
  }

  /**
   * Per-token logprobs of each datum's targets, under the model's current weights.
   * `reference: true` uses the base model (adapter off), the usual KL reference;
   * `reference: "treadle://<model_id>/state/<name>"` (a saveState) or
   * `"treadle://<model_id>/v/<v>"` (a published version still kept) uses weights you
   * own instead, e.g. the end of a supervised warm-up. Changes nothing: the model's
   * weights, gradients and optimizer state are untouched (the server keeps the loaded
   * reference, so asking every step reads the checkpoint once).
   */
  forwardLogprobs(data: readonly Datum[], options: ForwardLogprobsOptions = {}): Promise<ForwardBackwardOutput> {
    return this.ordered(() => {
      const [reference, referencePath] = referenceToWire(options.reference);
      return {
        request: {
          modelId: this.modelId,
          seqId: 0,
          data: convert.datumsToWire(data),
          reference,
          temperature: convert.temperatureToWire(options.temperature),
          referencePath,
        },
        send: (req) => this.caller.call(this.stub.forwardLogprobs.bind(this.stub), req, convert.forwardOutputFromWire),
      };
    });
  }

  /** Apply the accumulated gradient (AdamW) and zero it; a barrier. A step with no
   * gradient (`no_grad:value` = 1) emits a "NoGradientWarning" process warning. */
  optimStep(adamParams?: AdamParams): Promise<OptimStepResponse> {
    return this.ordered(() => ({
      request: { modelId: this.modelId, seqId: 0, adamParams: convert.adamToWire(adamParams) },
      send: (req) =>
        this.caller.call(this.stub.optimStep.bind(this.stub), req, (r) => convert.optimStepFromWire(r, this.modelId)),
    }));
  }

  /**
   * Publish the current weights as version v (= optimizer steps applied); resolves
   * with a sampler pinned to it. `inflight: true` (PipelineRL): sequences still
   * generating on a sampler following this model's `latest` weights continue under
   * the new ones (the model needs such a sampler, else INVALID_ARGUMENT).
   * `placement`: where that sampler samples, as `ServiceClient.createSamplingClient`'s
   * ("colocated", "pool", "auto"; undefined: the server's `--sampler-placement`);
   * "pool" with no sampler worker of the base refuses the sync (FAILED_PRECONDITION
   * naming the base model).
   */
  syncWeights(options: { inflight?: boolean; placement?: SamplerPlacementName } = {}): Promise<SamplingClient> {
    return this.ordered(() => ({
      request: {
        modelId: this.modelId,
        seqId: 0,
        createSampler: true,
        inflight: Boolean(options.inflight),
        placement: convert.samplerPlacementToWire(options.placement),
      },
      send: (req) =>
        this.caller.call(this.stub.syncWeights.bind(this.stub), req, (r) =>
          new SamplingClient(this.sampling, this.caller, {
            samplerId: r.samplerId,
            baseModel: this.baseModel,
            modelId: this.modelId,
            version: r.version,
          }),
        ),
    }));
  }

  /** Checkpoint weights + optimizer state + step; resolves with its treadle:// path. */
  saveState(name: string): Promise<SaveStateResponse> {
    return this.ordered(() => ({
      request: { modelId: this.modelId, seqId: 0, name: nonEmptyString(name, "name") },
      send: (req) =>
        this.caller.call(this.stub.saveState.bind(this.stub), req, (r) => ({ path: r.path, seqId: r.seqId, step: r.step })),
    }));
  }

  /** Replace this model's weights, optimizer state and step with a checkpoint's (with
   * `weightsOnly`: its weights and step, fresh Adam moments); resolves with the step. */
  loadState(path: string, opts: { weightsOnly?: boolean } = {}): Promise<number> {
    return this.ordered(() => ({
      request: {
        modelId: this.modelId,
        seqId: 0,
        path: nonEmptyString(path, "path"),
        weightsOnly: opts.weightsOnly ?? false,
      },
      send: (req) => this.caller.call(this.stub.loadState.bind(this.stub), req, (r) => r.step),
    }));
  }

  getInfo(): Promise<ModelInfo> {
    return this.caller.call(
      this.stub.getModelInfo.bind(this.stub),
      { modelId: this.modelId },
      convert.modelInfoFromWire,
    );
  }

  listCheckpoints(): Promise<CheckpointInfo[]> {
    return this.caller.call(this.stub.listCheckpoints.bind(this.stub), { modelId: this.modelId }, (r) =>
      r.checkpoints.map(convert.checkpointFromWire),
    );
  }

  /**
   * Build (and check) the request first, then take the seq_id: a request rejected
   * here uses no seq_id, so it leaves no gap the engine would wait for.
   */
  private ordered<Req extends { seqId: number }, Out>(
    build: () => { request: Req; send: (request: Req) => Promise<Out> },
  ): Promise<Out> {
    let built: { request: Req; send: (request: Req) => Promise<Out> };
    try {
      built = build();
    } catch (err) {
      return Promise.reject(err);
    }
    built.request.seqId = this.takeSeq();
    return built.send(built.request);
  }
}
