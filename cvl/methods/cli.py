"""`cvl methods`: list the registered methods with a one-line description and defaults."""

from __future__ import annotations

import click


@click.command("methods")
@click.option("--verbose", "-v", is_flag=True, help="Show the full docstring of each method.")
def methods(verbose: bool) -> None:
    """List the methods `cvl train --method` accepts, with their defaults.

    Override a default with `--method-arg NAME=VALUE` (repeatable) or `method_args:` in YAML.
    Any method combines with a replay buffer: `--buffer reservoir|ring|kmeans|mof`.
    """
    from cvl.methods.registry import all_methods
    from cvl.train.fsdp import method_support

    reg = all_methods()
    w = max(len(n) for n in reg)
    pad = " " * (w + 1)
    for name, cls in reg.items():
        click.echo(f"{name:<{w}} {cls.summary()}")
        if cls.defaults:
            click.echo(pad + "defaults: " + ", ".join(f"{k}={v}" for k, v in cls.defaults.items()))
        if cls.tunes:
            click.echo(pad + f"needs: --tune {' or '.join(cls.tunes)}")
        cached_why = cls().accum_refusal(None)  # at the method's defaults
        click.echo(
            pad + "--accum-mode cached: " + (f"refused: {cached_why}" if cached_why else "yes")
        )
        why = method_support(cls)
        if why is not True:
            click.echo(pad + f"--fsdp: not supported ({why})")
        if verbose and cls.__doc__:
            for line in cls.__doc__.strip().splitlines()[1:]:
                click.echo(pad + line.strip())
