"""Run in tinker-cookbook's own venv (see test_cookbook_adapter.py): a cookbook
``ProblemEnv`` group, built by the cookbook's ``ProblemGroupBuilder`` with its
``role_colon`` renderer, through ``treadle.rl``'s sync episode loop and
``run_episodes`` via ``treadle.rl.cookbook``. Prints what it saw as JSON."""

from __future__ import annotations

import json
import sys
from functools import partial

from tinker_cookbook import renderers
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

import treadle
from treadle import rl
from treadle.rl.cookbook import cookbook_groups


class OnePlusOne(ProblemEnv):
    def get_question(self) -> str:
        return "1+1="

    def check_answer(self, sample_str: str) -> bool:
        return sample_str.strip() == "2"

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "2"


def main() -> None:
    address, api_key, base, model_dir = sys.argv[1:5]
    renderer = renderers.get_renderer("role_colon", get_tokenizer(model_dir))
    builder = ProblemGroupBuilder(env_thunk=partial(OnePlusOne, renderer), num_envs=4)
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "1+1="}]).to_ints()
    params = treadle.SamplingParams(max_tokens=6, temperature=1.0)
    with treadle.ServiceClient(address, api_key=api_key) as service:
        trainer = service.create_lora_training_client(base, rank=4, seed=0)
        stats = list(
            rl.sync_episode_loop(
                trainer,
                cookbook_groups([builder, builder]),
                steps=2,
                groups_per_step=1,
                sampling_params=params,
                timeout=120.0,
            )
        )
        context = service.get_server_info().base_models[0].max_context
        (episodes,) = rl.run_episodes(
            trainer.sync_weights(),
            cookbook_groups([builder]),
            context_limit=context,
            sampling_params=params,
        )
    print(
        json.dumps(
            {
                "steps": [[s.step, s.rollouts, s.failed_episodes, s.reward] for s in stats],
                "prompt": prompt,
                "stop": renderer.get_stop_sequences(),
                "episodes": [
                    {
                        "error": e.error,
                        "done": e.done,
                        "reward": e.reward,
                        "observation": list(e.turns[0].observation) if e.turns else [],
                        "turns": len(e.turns),
                        "metrics": dict(e.turns[0].metrics) if e.turns else {},
                    }
                    for e in episodes
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
