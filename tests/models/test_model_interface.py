"""Every family declares its inputs (models/base.py) and has what those inputs promise the runner."""

import pytest

from loraplex.models.base import EncoderDecoderModel, ImageFeatureModel, ImageStateModel, ModelFamily, ModelInputs
from loraplex.models.registry import FAMILIES

PROMISES = {
    ModelInputs.ENCODER: EncoderDecoderModel,
    ModelInputs.IMAGE_FEATURES: ImageFeatureModel,
    ModelInputs.IMAGE_STATES: ImageStateModel,
}


def _members(protocol) -> set[str]:
    own = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return {name for name in own if not name.startswith("_")}


@pytest.mark.parametrize("family", sorted({f.model_class for f in FAMILIES.values()}, key=lambda c: c.__name__))
def test_a_family_declares_its_inputs_and_has_what_they_promise(family):
    assert ModelFamily in family.__mro__  # the defaults of what only some families have
    assert "inputs" in vars(family) and ModelInputs.TEXT in family.inputs
    for kind, protocol in PROMISES.items():
        missing = {name for name in _members(protocol) if not hasattr(family, name)}
        if kind in family.inputs:
            assert not missing, f"{family.__name__} takes {kind} but lacks {missing}"
        else:
            assert missing, f"{family.__name__} has the {kind} methods but does not declare {kind}"
    # At most one kind of per-request input: the runner picks one path per family.
    assert sum(kind in family.inputs for kind in PROMISES) <= 1
