/**
 * The names the public API gives the wire's enums, derived from the code generated
 * from the protos (`src/gen`, `npm run gen`) instead of listed by hand: a loss or a
 * stop reason added to `protos/` reaches this client with the regenerated code, and a
 * hand-written copy drifts (the last one lacked `gspo`). The Python SDK reads the
 * same enums the same way (`common_pb2.LossFn`).
 */
import { LossFn, StopReason as WireStopReason } from "./gen/treadle/v1/common.js";
import { SamplerPlacement } from "./gen/treadle/v1/sampling.js";

/** An enum's member names, less the proto's `*_UNSPECIFIED` and ts-proto's `UNRECOGNIZED`. */
type Members<E> = Exclude<keyof E, `${string}UNSPECIFIED` | "UNRECOGNIZED">;

/** A numeric enum's members as [name, value], those that are never sent (<= 0) aside. */
function members(e: Record<string, string | number>): [string, number][] {
  return Object.entries(e).filter((kv): kv is [string, number] => typeof kv[1] === "number" && kv[1] > 0);
}

/** Loss names: the proto's LossFn, lower-cased (`"cross_entropy"`, `"ppo"`, `"gspo"`, ...). */
export type LossFnName = Lowercase<Members<typeof LossFn>>;

/** Every loss the wire knows, by its name. */
export const LOSS_FNS: ReadonlyMap<LossFnName, LossFn> = new Map(
  members(LossFn).map(([name, value]) => [name.toLowerCase() as LossFnName, value as LossFn]),
);

type WireStop = Members<typeof WireStopReason>;

/** Which way of stopping ended a sequence whose stopReason is "stop": the wire's STOP
 * is the EOS token, its STOP_* reasons the others (`"stop_string"`, `"stop_token"`). */
export type StoppedBy = "eos" | Lowercase<Extract<WireStop, `STOP_${string}`>>;

/** Why a sequence ended: "stop" for EOS, a stop string and a stop token alike (tinker's
 * coarse reason; `SampledSequence.stoppedBy` tells which), else the wire's reason
 * lower-cased ("length", "cancelled", "partial"), as in the Python SDK. */
export type StopReason = Lowercase<Exclude<WireStop, `STOP_${string}`>>;

/** The wire's stop reason as [stopReason, stoppedBy]; a reason this client does not
 * know (a newer server) reads as a plain "stop". */
export function stopReasonFromWire(reason: WireStopReason): [StopReason, StoppedBy | undefined] {
  const name = reason > 0 ? (WireStopReason[reason] as WireStop | undefined) : undefined;
  if (name === undefined) return ["stop", undefined];
  if (name === "STOP") return ["stop", "eos"];
  if (name.startsWith("STOP_")) return ["stop", name.toLowerCase() as StoppedBy];
  return [name.toLowerCase() as StopReason, undefined];
}

/** Where a sampler samples (a distributed server; docs/topologies.md): the proto's
 * SamplerPlacement without its prefix, lower-cased (`"colocated"`, `"pool"`, `"auto"`). */
export type SamplerPlacementName = Lowercase<
  Members<typeof SamplerPlacement> extends `SAMPLER_PLACEMENT_${infer P}` ? P : never
>;

/** Every placement the wire knows, by its name. */
export const SAMPLER_PLACEMENTS: ReadonlyMap<SamplerPlacementName, SamplerPlacement> = new Map(
  members(SamplerPlacement).map(([name, value]) => [
    name.replace(/^SAMPLER_PLACEMENT_/, "").toLowerCase() as SamplerPlacementName,
    value as SamplerPlacement,
  ]),
);
