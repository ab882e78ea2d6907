"""The demo's reward: the answer's token ids then EOS, compared as ids (decoding
skips special tokens, so a completion with one inside would pass as the answer)."""

from __future__ import annotations

from pathlib import Path

from treadle.server.demo import Problem, exact_match
from treadle.tokenizer import Tokenizer
from treadle.types import SampledSequence


def _seq(tokens: list[int], stop_reason: str = "stop") -> SampledSequence:
    return SampledSequence(tokens=tokens, logprobs=[0.0] * len(tokens), stop_reason=stop_reason)  # type: ignore[arg-type]


def test_exact_match_compares_token_ids(tiny_model_dir: Path) -> None:
    tok = Tokenizer(tiny_model_dir)
    assert tok.eos_token_id is not None and tok.bos_token_id is not None
    p = Problem(5, 7)  # "12": two tokens
    answer = tok.encode(p.answer)
    assert len(answer) == 2
    assert exact_match(tok, _seq([*answer, tok.eos_token_id]), p) == 1.0
    assert exact_match(tok, _seq(answer, "length"), p) == 0.0  # no EOS: cut off
    # the answer with a special token inside decodes to the answer, and is wrong
    inside = [answer[0], tok.bos_token_id, *answer[1:], tok.eos_token_id]
    assert tok.decode(inside) == tok.decode([*answer, tok.eos_token_id])
    assert exact_match(tok, _seq(inside), p) == 0.0
