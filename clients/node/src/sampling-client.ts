/**
 * SamplingClient: generation from one sampler (a base model, a pinned weight
 * version, or a model's latest weights).
 */
import type { ClientReadableStream } from "@grpc/grpc-js";
import * as convert from "./convert.js";
import { InvalidArgumentError } from "./errors.js";
import type { SampleStreamResponse } from "./gen/treadle/v1/sampling.js";
import type { SamplingServiceClient } from "./gen/treadle/v1/sampling.js";
import { asTreadleError, type Caller } from "./rpc.js";
import type { SampleResponse, SamplerInfo, SamplingParams, StreamedSample } from "./types.js";
import { integer, type NumericArray } from "./validate.js";

export class SamplingClient {
  private seq = 0;

  /** Made by `ServiceClient.createSamplingClient` or `TrainingClient.syncWeights`. */
  constructor(
    private readonly stub: SamplingServiceClient,
    private readonly caller: Caller,
    readonly info: SamplerInfo,
  ) {}

  get samplerId(): string {
    return this.info.samplerId;
  }
  /** The pinned weight version; undefined when following `latest`. */
  get version(): number | undefined {
    return this.info.version;
  }

  /**
   * `numSamples` completions of `prompt` (token ids), returned together. Each call
   * gets a per-sampler seq_id, so a retried call is answered from the server's record.
   */
  sample(prompt: NumericArray, numSamples = 1, params?: SamplingParams): Promise<SampleResponse> {
    try {
      const request = this.request(prompt, numSamples, params);
      request.seqId = ++this.seq;
      return this.caller.call(this.stub.sample.bind(this.stub), request, convert.sampleResponseFromWire);
    } catch (err) {
      return Promise.reject(err);
    }
  }

  /**
   * A streamed request: yields each sample the moment it finishes (short answers
   * first) as `{index, sequence}`; every index arrives once. Leaving the loop early
   * (`break`, an exception) cancels the samples still generating. Not retried: a
   * stream that fails throws its typed error from the loop.
   */
  async *sampleStream(prompt: NumericArray, numSamples = 1, params?: SamplingParams): AsyncGenerator<StreamedSample> {
    const request = this.request(prompt, numSamples, params);
    const call: ClientReadableStream<SampleStreamResponse> = this.stub.sampleStream(
      request,
      this.caller.metadata(),
      this.caller.callOptions(),
    );
    let finished = false;
    try {
      for await (const msg of call) yield convert.streamedSampleFromWire(msg as SampleStreamResponse);
      finished = true;
    } catch (err) {
      throw asTreadleError(err);
    } finally {
      if (!finished) call.cancel();
    }
  }

  /**
   * Continue partial rollouts: the `resumeHandle`s of sequences that stopped with
   * "partial". Not retried (a retry could find its handles consumed).
   */
  resume(resumeHandles: readonly string[], params?: SamplingParams): Promise<SampleResponse> {
    try {
      if (!Array.isArray(resumeHandles) || resumeHandles.length === 0) {
        throw new InvalidArgumentError("resumeHandles: give at least one");
      }
      const request = {
        samplerId: this.info.samplerId,
        resumeHandles: [...resumeHandles],
        params: convert.samplingParamsToWire(params),
      };
      return this.caller.call(this.stub.resume.bind(this.stub), request, convert.sampleResponseFromWire, {
        retry: false,
      });
    } catch (err) {
      return Promise.reject(err);
    }
  }

  private request(prompt: NumericArray, numSamples: number, params: SamplingParams | undefined) {
    return {
      samplerId: this.info.samplerId,
      seqId: 0,
      prompt: convert.promptToWire(prompt),
      numSamples: integer(numSamples, "numSamples", { min: 1, max: 2 ** 31 - 1 }),
      params: convert.samplingParamsToWire(params),
      // prompt logprobs are not asked for by this client (the Python SDK's sample and
      // compute_logprobs ask for them)
      promptLogprobs: false,
      topkPromptLogprobs: 0,
    };
  }
}
