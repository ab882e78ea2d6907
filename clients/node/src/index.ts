/** @treadle/client: the TypeScript/Node.js client of treadle. */
export { ServiceClient, DEFAULT_ADDRESS, type ServiceClientOptions, type LoraOptions } from "./service-client.js";
export { TrainingClient, type ForwardBackwardOptions, type ForwardLogprobsOptions } from "./training-client.js";
export { SamplingClient } from "./sampling-client.js";
export { Tokenizer } from "./tokenizer.js";
export * from "./errors.js";
export type * from "./types.js";
export type { NumericArray } from "./validate.js";
export * as rl from "./rl.js";
