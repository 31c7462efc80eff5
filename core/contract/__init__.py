"""The contract: what plugins and architectures are written against, below every implementation.

* :mod:`~quantplug.contract.scheme`: :class:`LinearScheme` (what a backend subclasses), the
  records it exchanges with the plan (``Source``, ``SlotSources``, ``SplitRule``, ``Part``),
  :class:`PlannedModule` and the stacked-linear layouts;
* :mod:`~quantplug.contract.options`: :class:`LoadOptions` and the core's option table (the
  resolution against the backends' declarations is :mod:`quantplug.options`);
* :mod:`~quantplug.contract.config`: the model configuration (``ModelConfig``, ``RopeConfig``,
  ``parse_model_config``);
* :mod:`~quantplug.contract.arch`: :class:`ArchSpec`, the plan oracle (``PlanOracle``) and the
  ``quantplug.architectures`` entry-point group;
* :mod:`~quantplug.contract.plan`, :mod:`~quantplug.contract.checkpoint`,
  :mod:`~quantplug.contract.plugins`, :mod:`~quantplug.contract.experts`: protocols of the load
  plan, the checkpoint index, the plugin manager and routed experts, for code below the modules
  that define them (the hook specifications, the tensor-parallel split, option resolution, the
  expert store).

It imports only ``quantplug.types``, ``quantplug.errors`` and ``quantplug.validation`` (torch and
the standard library beside). Plugins import these names from :mod:`quantplug.api`.
"""
