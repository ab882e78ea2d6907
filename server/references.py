"""``ForwardLogprobs(reference_path=...)``: a ``treadle://`` path -> the engine's
``ReferenceWeights``, checked against the tenant's own models and checkpoints.

Another tenant's path answers NOT_FOUND with the same message as a path that
does not exist (tenants are walls). What the engine cannot know is checked
here: the version is still kept, and it is of a model on the same base and
dtype (its weights fit this model's forward). A state's base model is in its
manifest, which the engine checks when it loads it.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from treadle.common.db import models as db
from treadle.common.engine.domain import ReferenceWeights
from treadle.common.store import SCHEME, parse_state_uri, parse_weights_uri, storage_path_str
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.server.db import queries

FIELD = "reference_path"


def resolve(s: Session, tenant: str, model: db.Model, uri: str) -> ReferenceWeights:
    """The reference ``uri`` names, for the tenant's ``model``'s forward."""
    parts = uri[len(SCHEME) :].split("/") if uri.startswith(SCHEME) else []
    if len(parts) == 3 and parts[1] == "state":
        parse_state_uri(uri, FIELD)
        row = queries.get_checkpoint_by_uri(s, tenant, uri)
        if row is None:
            raise _not_found(uri)
        return ReferenceWeights(uri, directory=storage_path_str(row.storage_path))
    if len(parts) == 3 and parts[1] == "v":
        ref = parse_weights_uri(uri, FIELD)
        assert ref.version is not None
        owner = queries.get_model(s, tenant, ref.model_id)
        version = s.get(db.WeightVersion, (ref.model_id, ref.version))
        if owner is None or version is None:
            raise _not_found(uri)
        if version.released:
            raise NotFoundError(
                f"{FIELD}: {uri!r} is no longer kept (the server keeps the latest versions "
                "only); save_state the weights you want as a reference and name that state"
            )
        if (owner.base_model, owner.dtype) != (model.base_model, model.dtype):
            raise InvalidArgumentError(
                f"{FIELD}: {uri!r} is a version of a {owner.dtype} {owner.base_model!r} model; "
                f"this model is {model.dtype} {model.base_model!r}"
            )
        return ReferenceWeights(uri, model_id=ref.model_id, version=ref.version)
    raise InvalidArgumentError(
        f"{FIELD}: {uri!r} is not a treadle://<model_id>/state/<name> or "
        "treadle://<model_id>/v/<version> path (reference=True is the base model)"
    )


def _not_found(uri: str) -> NotFoundError:
    return NotFoundError(f"{FIELD}: {uri!r} not found")
