"""Where a chaos run's fault injectors plug into the apps. Production code names no
injector: kvfabric.deploy.chaos registers them here when it is imported, and an app asked
for chaos (AppArgs.chaos, LLMAppArgs.chaos_file) takes what is registered, in the process
that builds the app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the actors layer imports Ray: only its types are needed here
    from kvfabric.actors.node.hooks import NodeHooks
    from kvfabric.actors.node.node_actor import NodeConfig


@dataclass(frozen=True)
class Injectors:
    # The reference app's nodes: NodeConfig.hooks, built in each node actor's process.
    node_hooks: Callable[[NodeConfig], NodeHooks]
    # The same hooks as "module:name", as the connector's `node_hooks` setting names them.
    node_hooks_path: str
    # The connector settings that arm a step-fault file (its path) in every engine.
    step_faults: Callable[[str], dict[str, Any]]

    def connector_settings(self, chaos_file: str) -> dict[str, Any]:
        """The FabricConnector settings that turn chaos on in a vLLM app: the node
        actors' hooks and the engines' step-fault file at `chaos_file`."""
        return {"node_hooks": self.node_hooks_path, **self.step_faults(chaos_file)}


class NoInjectors(RuntimeError):
    """Chaos was asked for, but no injectors are registered in this process."""


_registered: list[Injectors] = []


def register(injectors: Injectors) -> None:
    _registered[:] = [injectors]


def registered() -> Injectors:
    if not _registered:
        raise NoInjectors("chaos asks for the fault injectors: import kvfabric.deploy.chaos first")
    return _registered[0]
