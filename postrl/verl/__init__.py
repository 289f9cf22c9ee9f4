"""verl compatibility: verl's launch keys translated into postrl's typed config.

``postrl verl [verl key=value ...]`` and ``python -m postrl.verl.main_ppo [...]`` accept the
arguments of ``python -m verl.trainer.main_ppo``. One table (:data:`postrl.verl.mapping.RULES`)
says, for every key of verl's PPO trainer config, which postrl setting it becomes, why it has
no effect here, or why it is rejected and what to use instead. ``docs/verl.md`` is generated
from that table.

Public API::

    from postrl.verl import translate, Translation, VerlConfigError, RULES
"""

from __future__ import annotations

from postrl.verl.mapping import RULES
from postrl.verl.translate import Translation, VerlConfigError, translate

__all__ = ["RULES", "Translation", "VerlConfigError", "translate"]
