"""The registry of rental policies, by name: the recipe's `planner.policy` and `elastic simulate
--policy` pick from it. To add a policy, subclass `elastic.policy.rules.Policy` (a `decide` from a
`Snapshot` to actions, and its data: `name`, `spot`, `whole_job`, `moves_on_loss`) and list an
instance here; the executor (`elastic.policy.executor`) carries out its actions in the driver and in the
simulator alike."""

from __future__ import annotations

from elastic.errors import UserError
from elastic.policy.baselines import OnDemand, SkypilotLike, SpotStatic, UniformProgress
from elastic.policy.rules import ElasticPolicy, Policy

POLICIES: dict[str, Policy] = {p.name: p for p in (ElasticPolicy(), OnDemand(), SpotStatic(), SkypilotLike(),
                                                   UniformProgress())}


def policy(name: str) -> Policy:
    """The registered policy called `name`; a UserError (one line, the names listed) for another."""
    if name not in POLICIES:
        raise UserError(f"no rental policy {name!r}: choose from {', '.join(POLICIES)}")
    return POLICIES[name]
