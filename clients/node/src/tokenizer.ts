/**
 * A thin tokenizer over `@huggingface/tokenizers` (pure JS), loaded from the files
 * the server sends (`GetTokenizer`), so Node clients tokenize locally, without a
 * model hub, exactly as the Python SDK's `treadle.Tokenizer` does.
 */
import { Tokenizer as HFTokenizer } from "@huggingface/tokenizers";
import { InvalidArgumentError } from "./errors.js";

type SpecialToken = string | { content?: string } | null | undefined;

export class Tokenizer {
  readonly bosTokenId: number | undefined;
  readonly eosTokenId: number | undefined;
  readonly padTokenId: number | undefined;
  private readonly tok: HFTokenizer;
  private readonly vocab: number;

  /** `files` maps file names (tokenizer.json, tokenizer_config.json, ...) to their bytes. */
  constructor(files: ReadonlyMap<string, Buffer>) {
    const json = files.get("tokenizer.json");
    if (json === undefined) {
      throw new InvalidArgumentError(`tokenizer: no tokenizer.json among ${[...files.keys()].join(", ")}`);
    }
    const tokenizerJson = JSON.parse(json.toString("utf8")) as Record<string, unknown>;
    const cfgBytes = files.get("tokenizer_config.json");
    const config = (cfgBytes ? JSON.parse(cfgBytes.toString("utf8")) : {}) as Record<string, SpecialToken>;
    this.tok = new HFTokenizer(tokenizerJson, config);
    this.bosTokenId = this.special(config["bos_token"]);
    this.eosTokenId = this.special(config["eos_token"]);
    this.padTokenId = this.special(config["pad_token"]);
    const model = tokenizerJson["model"] as { vocab?: Record<string, number> } | undefined;
    const added = (tokenizerJson["added_tokens"] as { id: number }[] | undefined) ?? [];
    const ids = [...Object.values(model?.vocab ?? {}), ...added.map((t) => t.id)];
    this.vocab = ids.length ? Math.max(...ids) + 1 : 0;
  }

  private special(token: SpecialToken): number | undefined {
    const content = typeof token === "object" && token !== null ? token.content : token;
    return content == null ? undefined : this.tok.token_to_id(content);
  }

  /** Size of the vocabulary, added tokens included. */
  get vocabSize(): number {
    return this.vocab;
  }

  encode(text: string, { addSpecialTokens = false }: { addSpecialTokens?: boolean } = {}): number[] {
    if (typeof text !== "string") throw new InvalidArgumentError(`text: expected a string, got ${typeof text}`);
    return this.tok.encode(text, { add_special_tokens: addSpecialTokens }).ids;
  }

  decode(ids: readonly number[], { skipSpecialTokens = true }: { skipSpecialTokens?: boolean } = {}): string {
    return this.tok.decode([...ids], { skip_special_tokens: skipSpecialTokens });
  }
}
