/**
 * The client's gRPC plumbing (the Python SDK's `treadle._rpc`): channel options, auth
 * metadata, deadlines, status -> typed error, and retries of calls that are safe to
 * repeat. Ordered training calls carry their seq_id, so the engine de-duplicates a
 * repeat; a retry therefore never applies a step twice.
 */
import { credentials, type ChannelCredentials, Metadata, type ServiceError, status } from "@grpc/grpc-js";
import { errorForCode, type TreadleError, UnavailableError } from "./errors.js";

/** gRPC's 4 MB default is far too small for batches, tokenizers and checkpoints. */
export const MAX_MESSAGE_BYTES = 256 * 1024 * 1024;
export const RETRY_AFTER_KEY = "treadle-retry-after-s";
/** How long, in all, a call waits out quota refusals (RESOURCE_EXHAUSTED with a delay). */
export const QUOTA_WAIT_S = 600;

export const CHANNEL_OPTIONS = {
  "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
  "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
  "grpc.keepalive_time_ms": 30_000,
  "grpc.keepalive_permit_without_calls": 1,
};

export function channelCredentials(rootCertificates?: Buffer | string): ChannelCredentials {
  if (rootCertificates === undefined) return credentials.createInsecure();
  const pem = typeof rootCertificates === "string" ? Buffer.from(rootCertificates) : rootCertificates;
  return credentials.createSsl(pem);
}

/** A gRPC failure as the treadle error of its status (retry-after from the trailers). */
export function errorFromStatus(err: Partial<ServiceError> & Error): TreadleError {
  const code = typeof err.code === "number" ? (status[err.code] ?? "UNKNOWN") : "UNKNOWN";
  let retryAfter: number | undefined;
  const value = err.metadata?.get(RETRY_AFTER_KEY)[0];
  if (value !== undefined) {
    const parsed = Number(value.toString());
    if (Number.isFinite(parsed)) retryAfter = parsed;
  }
  return errorForCode(code, err.details || err.message || code, retryAfter);
}

type Unary<Req, Res> = (
  request: Req,
  metadata: Metadata,
  options: { deadline?: Date },
  callback: (err: ServiceError | null, response: Res) => void,
) => unknown;

export interface CallerOptions {
  apiKey?: string | undefined;
  maxRetries?: number | undefined;
  timeoutS?: number | undefined;
  quotaWaitS?: number | undefined;
  /** Told of each retry before its wait (the Python SDK logs a warning there). */
  onRetry?: ((error: TreadleError, delayS: number) => void) | undefined;
}

/** Issues unary calls as Promises, with metadata, deadlines and bounded retries. */
export class Caller {
  readonly maxRetries: number;
  readonly timeoutS: number | undefined;
  readonly quotaWaitS: number;
  private readonly apiKey: string | undefined;
  private readonly onRetry: ((error: TreadleError, delayS: number) => void) | undefined;

  constructor(options: CallerOptions = {}) {
    this.apiKey = options.apiKey ?? process.env["TREADLE_API_KEY"] ?? undefined;
    this.maxRetries = options.maxRetries ?? 5;
    this.timeoutS = options.timeoutS;
    this.quotaWaitS = options.quotaWaitS ?? QUOTA_WAIT_S;
    this.onRetry = options.onRetry;
  }

  metadata(): Metadata {
    const md = new Metadata();
    if (this.apiKey) md.set("authorization", `Bearer ${this.apiKey}`);
    return md;
  }

  /** Call options of one attempt: the deadline, if the client has one. */
  callOptions(): { deadline?: Date } {
    return this.timeoutS === undefined ? {} : { deadline: new Date(Date.now() + this.timeoutS * 1000) };
  }

  /**
   * Send `request` now; resolve with `convert(response)`. `method` is a generated
   * client's method bound to its client. `retry=false` for calls a repeat could
   * change (resume handles are consumed).
   */
  async call<Req, Res, Out>(
    method: Unary<Req, Res>,
    request: Req,
    convert: (response: Res) => Out,
    { retry = true }: { retry?: boolean } = {},
  ): Promise<Out> {
    let attempt = 0;
    let waited = 0;
    for (;;) {
      try {
        const response = await new Promise<Res>((resolve, reject) => {
          method(request, this.metadata(), this.callOptions(), (err, res) => (err ? reject(err) : resolve(res)));
        });
        return convert(response);
      } catch (raw) {
        if (!(raw instanceof Error) || typeof (raw as ServiceError).code !== "number") throw raw;
        const error = errorFromStatus(raw as ServiceError);
        const delay = retry ? this.retryDelay(error, attempt, waited) : undefined;
        if (delay === undefined) throw error;
        this.onRetry?.(error, delay);
        if (error.code === "RESOURCE_EXHAUSTED") waited += delay;
        else attempt += 1;
        await sleep(delay);
      }
    }
  }

  /**
   * Seconds to wait before trying again, or undefined to give up. A quota refusal
   * says how long to wait (`retryAfterS`) and is waited out for up to `quotaWaitS`
   * in all, not counted as a failed attempt; one without a delay (a request over the
   * per-request quota) cannot succeed by waiting. UNAVAILABLE backs off
   * exponentially, `maxRetries` times.
   */
  retryDelay(error: TreadleError, attempt: number, waited: number): number | undefined {
    if (error.code === "RESOURCE_EXHAUSTED") {
      if (error.retryAfterS === undefined || waited >= this.quotaWaitS) return undefined;
      return error.retryAfterS * (1 + 0.25 * Math.random()); // spread the herd
    }
    if (error.code === "UNAVAILABLE" && attempt < this.maxRetries) {
      return Math.min(8, 0.2 * 2 ** attempt) * (0.5 + Math.random());
    }
    return undefined;
  }
}

export function sleep(seconds: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, seconds * 1000));
}

/** An unexpected failure of a stream (not a gRPC status) as UNAVAILABLE. */
export function asTreadleError(err: unknown): Error {
  if (err instanceof Error && typeof (err as ServiceError).code === "number") {
    return errorFromStatus(err as ServiceError);
  }
  return err instanceof Error ? err : new UnavailableError(String(err));
}
