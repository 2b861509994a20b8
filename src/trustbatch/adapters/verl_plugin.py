"""Importing this module registers trustbatch's objectives in verl with their default options.

For ``VERL_USE_EXTERNAL_MODULES=trustbatch.adapters.verl_plugin``: verl imports the named modules
whenever ``verl`` itself is imported, so every verl process (driver and workers) gets the losses.
For other options, point the variable at a module of your own that calls ``register_with_verl``.
"""

from .verl import register_with_verl

REGISTERED = register_with_verl()
