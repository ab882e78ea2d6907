/**
 * One error hierarchy, the Python SDK's (`treadle.errors`): the same class names and
 * gRPC status codes, so code that catches `NotFoundError` reads the same in both
 * languages. The server's status maps to a class here (`errorFromStatus`); checks
 * this client makes before sending raise the same classes, so a caller catches
 * `InvalidArgumentError` whether the check ran locally or on the server.
 */

/** Base of every error treadle raises on purpose. */
export class TreadleError extends Error {
  /** The canonical gRPC status name, e.g. "INVALID_ARGUMENT". */
  readonly code: string;
  /** The message without the code: the server's, or this client's check's. */
  readonly details: string;
  /** For RESOURCE_EXHAUSTED: seconds to wait before trying again (when the server said). */
  readonly retryAfterS: number | undefined;

  constructor(message: string, options: { retryAfterS?: number; code?: string } = {}) {
    const code = options.code ?? (new.target as unknown as { CODE: string }).CODE ?? "UNKNOWN";
    super(`${code}: ${message}`);
    this.name = new.target.name;
    this.code = code;
    this.details = message;
    this.retryAfterS = options.retryAfterS;
  }

  static readonly CODE: string = "UNKNOWN";
}

/** Bad input; the message names the offending field. */
export class InvalidArgumentError extends TreadleError {
  static override readonly CODE = "INVALID_ARGUMENT";
}
/** The id does not exist, or belongs to another tenant (indistinguishable). */
export class NotFoundError extends TreadleError {
  static override readonly CODE = "NOT_FOUND";
}
export class AlreadyExistsError extends TreadleError {
  static override readonly CODE = "ALREADY_EXISTS";
}
/** E.g. a repeated seq_id with a different payload. */
export class FailedPreconditionError extends TreadleError {
  static override readonly CODE = "FAILED_PRECONDITION";
}
/** E.g. a call waited too long for a missing predecessor seq_id. */
export class AbortedError extends TreadleError {
  static override readonly CODE = "ABORTED";
}
/** Quota or capacity; `retryAfterS` says when to try again. */
export class ResourceExhaustedError extends TreadleError {
  static override readonly CODE = "RESOURCE_EXHAUSTED";
}
/** A worker fault or shutdown; the model stays at its last applied step. */
export class UnavailableError extends TreadleError {
  static override readonly CODE = "UNAVAILABLE";
}
export class UnauthenticatedError extends TreadleError {
  static override readonly CODE = "UNAUTHENTICATED";
}
export class DeadlineExceededError extends TreadleError {
  static override readonly CODE = "DEADLINE_EXCEEDED";
}
export class CancelledError extends TreadleError {
  static override readonly CODE = "CANCELLED";
}
export class InternalError extends TreadleError {
  static override readonly CODE = "INTERNAL";
}
/** This deployment does not offer the call (e.g. streamed sampling on Celery workers). */
export class UnimplementedError extends TreadleError {
  static override readonly CODE = "UNIMPLEMENTED";
}

type ErrorClass = typeof TreadleError;

export const ERRORS_BY_CODE: Readonly<Record<string, ErrorClass>> = Object.fromEntries(
  [
    InvalidArgumentError,
    NotFoundError,
    AlreadyExistsError,
    FailedPreconditionError,
    AbortedError,
    ResourceExhaustedError,
    UnavailableError,
    UnauthenticatedError,
    DeadlineExceededError,
    CancelledError,
    InternalError,
    UnimplementedError,
  ].map((cls) => [cls.CODE, cls]),
);

/** The error class of a status name; an unknown name gives a TreadleError carrying it. */
export function errorForCode(code: string, message: string, retryAfterS?: number): TreadleError {
  const cls = ERRORS_BY_CODE[code];
  return cls !== undefined
    ? new cls(message, { retryAfterS })
    : new TreadleError(message, { retryAfterS, code });
}
