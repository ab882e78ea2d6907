/**
 * Runtime checks at the public boundary. TypeScript's types vanish at run time and
 * JavaScript callers have none, so every public entry point checks what it is given
 * before anything is sent, and names the field in an InvalidArgumentError.
 */
import { InvalidArgumentError } from "./errors.js";

/** Array-likes of numbers the client accepts for token ids and per-token values. */
export type NumericArray = ArrayLike<number>;

export function isNumericArray(value: unknown): value is NumericArray {
  return (
    Array.isArray(value) ||
    (ArrayBuffer.isView(value) && !(value instanceof DataView) && !isBigIntArray(value))
  );
}

function isBigIntArray(value: unknown): boolean {
  return value instanceof BigInt64Array || value instanceof BigUint64Array;
}

/** Token ids: a non-empty-or-empty array of non-negative safe integers. */
export function tokenIds(value: unknown, field: string, { nonEmpty = false } = {}): number[] {
  if (!isNumericArray(value)) {
    throw new InvalidArgumentError(`${field}: expected an array of token ids, got ${describe(value)}`);
  }
  const out = Array.from(value as NumericArray);
  out.forEach((t, i) => {
    if (typeof t !== "number" || !Number.isSafeInteger(t) || t < 0) {
      throw new InvalidArgumentError(
        `${field}[${i}]: token ids must be non-negative integers, got ${describe(t)}`,
      );
    }
  });
  if (nonEmpty && out.length === 0) {
    throw new InvalidArgumentError(`${field}: must not be empty`);
  }
  return out;
}

/** Finite numbers (weights, advantages, logprobs). */
export function finiteNumbers(value: unknown, field: string): NumericArray {
  if (!isNumericArray(value)) {
    throw new InvalidArgumentError(`${field}: expected an array of numbers, got ${describe(value)}`);
  }
  const arr = value as NumericArray;
  for (let i = 0; i < arr.length; i++) {
    const v = arr[i];
    if (typeof v !== "number" || !Number.isFinite(v)) {
      throw new InvalidArgumentError(`${field}[${i}]: must be a finite number, got ${describe(v)}`);
    }
  }
  return arr;
}

export function integer(
  value: unknown,
  field: string,
  { min = Number.MIN_SAFE_INTEGER, max = Number.MAX_SAFE_INTEGER } = {},
): number {
  if (typeof value !== "number" || !Number.isSafeInteger(value) || value < min || value > max) {
    const range = max === Number.MAX_SAFE_INTEGER ? `>= ${min}` : `in ${min}..${max}`;
    throw new InvalidArgumentError(`${field}: must be an integer ${range}, got ${describe(value)}`);
  }
  return value;
}

export function finite(value: unknown, field: string, { min = -Infinity } = {}): number {
  if (typeof value !== "number" || !Number.isFinite(value) || value < min) {
    const bound = min === -Infinity ? "" : ` >= ${min}`;
    throw new InvalidArgumentError(`${field}: must be a finite number${bound}, got ${describe(value)}`);
  }
  return value;
}

export function nonEmptyString(value: unknown, field: string): string {
  if (typeof value !== "string" || value.length === 0) {
    throw new InvalidArgumentError(`${field}: must be a non-empty string, got ${describe(value)}`);
  }
  return value;
}

export function describe(value: unknown): string {
  if (typeof value === "string") return JSON.stringify(value.length > 40 ? `${value.slice(0, 40)}...` : value);
  if (typeof value === "number" || typeof value === "boolean" || typeof value === "bigint") return String(value);
  if (value === null || value === undefined) return String(value);
  if (Array.isArray(value)) return `an array of ${value.length}`;
  return (value as object).constructor?.name ?? typeof value;
}
