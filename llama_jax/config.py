"""Print a resolved run config: ``python -m llama_jax.config --config configs/X.py [--config.a.b=v]``.

Config files import their starting point from here (``from llama_jax import config as config_lib``, then
``config_lib.base_run_config()`` or ``config_lib.load_run_config("configs/other.py")``): the two names are the run
config's (core/run_config.py), re-exported under the name config files have always used.
"""

from __future__ import annotations

from llama_jax import cli
from llama_jax.core.run_config import base_run_config, load_run_config

__all__ = ["base_run_config", "load_run_config", "main"]


def main(argv=None) -> None:
  config_flag = cli.define_config_flag(argv, "configs/tiny.py")

  def show(_):
    run_config = cli.run_config_from_flag_or_exit(config_flag)
    print(config_flag.value)
    model = run_config.model
    print(f"model ({model.num_params():,} parameters, MLP width {model.hidden_dim}):")
    print(model.to_json())

  cli.run_absl_command(show, argv, (config_flag,))


if __name__ == "__main__":
  main()
