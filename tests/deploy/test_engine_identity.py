"""An engine's index identity maps back to its node (and so to the replica there)."""

import pytest
from kvfabric.deploy.serving.engine_identity import engine_index_node, is_engine, node_actor_of


def test_an_engine_maps_back_to_its_node_and_a_node_to_itself() -> None:
    name = engine_index_node("kvf-node-abc", "replica-1")
    assert is_engine(name) and node_actor_of(name) == "kvf-node-abc"
    assert not is_engine("kvf-node-abc") and node_actor_of("kvf-node-abc") == "kvf-node-abc"


@pytest.mark.parametrize(
    "node,slot",
    [
        ("", "0"),
        ("n", ""),
        ("a/engine/b", "0"),
        ("n", "x/engine/y"),
        ("n" * 250, "slot-1"),
        (3, "0"),
    ],
)
def test_bad_identities_are_refused(node, slot) -> None:
    with pytest.raises(ValueError):
        engine_index_node(node, slot)
