"""A thin tokenizer over the ``tokenizers`` library, loaded from files the server
sends (``GetTokenizer``), so clients tokenize locally without a model hub."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._tok = _HFTokenizer.from_file(str(self.directory / "tokenizer.json"))
        config: dict = {}
        cfg_path = self.directory / "tokenizer_config.json"
        if cfg_path.exists():
            config = json.loads(cfg_path.read_text())
        self.bos_token_id = self._special_id(config.get("bos_token"))
        self.eos_token_id = self._special_id(config.get("eos_token"))
        self.pad_token_id = self._special_id(config.get("pad_token"))

    def _special_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """The ids this tokenizer knows, special and added tokens included (what
        transformers calls ``len(tokenizer)``). The model's own ``vocab_size``
        (``BaseModelInfo.vocab_size``, its embedding rows) may be larger: models
        pad it, and ids past the tokenizer's decode to nothing."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
