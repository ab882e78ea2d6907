"""tinker-cookbook's ``resolve_renderer_name_from_checkpoint_or_default`` against a
server: a run created with the renderer's name in its user_metadata (as the
cookbook's trainers do), checkpointed both ways; prints one JSON line of what the
function resolved for each checkpoint. Run by the cookbook's interpreter."""

from __future__ import annotations

import json
import sys

import tinker
from tinker_cookbook import checkpoint_utils, model_info

url, model = sys.argv[1], sys.argv[2]
metadata = {"recipe_name": "issue-40"}
checkpoint_utils.add_renderer_name_to_user_metadata(metadata, "llama3")
service = tinker.ServiceClient(base_url=url)
trainer = service.create_lora_training_client(base_model=model, rank=2, user_metadata=metadata)
state = trainer.save_state("renderer").result().path
sampler = trainer.save_weights_for_sampler("renderer-s").result().path
resolved = {
    path: checkpoint_utils.resolve_renderer_name_from_checkpoint_or_default(
        model_name=model,
        explicit_renderer_name=None,
        load_checkpoint_path=path,
        base_url=url,
    )
    for path in (state, sampler)
}
print(
    json.dumps(
        {
            "resolved": resolved,
            "default": model_info.get_recommended_renderer_name(model),
            "run_metadata": service.create_rest_client()
            .get_training_run_by_tinker_path(state)
            .result()
            .user_metadata,
        }
    )
)
service.close("success").result()
