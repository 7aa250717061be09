"""`v4`: the command line. Subcommands load lazily so `v4 config show` never pays for ray/torch."""
from __future__ import annotations

import importlib
import os
import sys

import click

from launcher.errors import EXIT_CODES, V4Error

# name -> "module:attribute" of a click command or group
COMMANDS = {
    "run": "launcher.commands.run:run",
    "config": "launcher.commands.config:config",
    "preflight": "launcher.commands.preflight:preflight",
    "cluster": "launcher.commands.cluster:cluster",
    "bootstrap": "launcher.commands.bootstrap:bootstrap",
    "runs": "launcher.commands.runs:runs",
    "ckpt": "launcher.commands.ckpt:ckpt",
    "bench": "launcher.commands.bench:bench",
    "nan": "launcher.commands.nan:nan",
    "rl": "launcher.commands.rl:rl",
    "plan": "launcher.commands.plan:plan",
    "completion": "launcher.cli:completion",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def resolve_command(self, ctx, args):
        # click suggests from self.commands, which a lazy group leaves empty
        if args and args[0] not in COMMANDS and not args[0].startswith("-"):
            raise click.exceptions.NoSuchCommand(args[0], possibilities=list(COMMANDS), ctx=ctx)
        return super().resolve_command(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            # the reader closed the pipe (`v4 config keys | head`): it has what it wanted, so exit 0 (click would
            # exit 1). stdout goes to devnull so that the interpreter's final flush does not fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise click.exceptions.Exit(0) from None

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


EPILOG = "\b\nExit codes:\n" + "\n".join(f"  {c:<4} {w}" for c, w in EXIT_CODES.items())


@click.group(cls=LazyGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="v4-launcher")
def cli():
    """Bring up a GPU cluster and run staged DeepSeek-V4 SFT/RL experiments on it.

    \b
    Start here:
      v4 config show --preset smoke --explain    what a run would use, and where each value came from
      v4 run --preset smoke --dry-run            the whole plan, touching nothing
      v4 run --preset smoke                      run it (local Ray + CPU when there is no cluster/GPU)
    """


@click.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell):
    """Print the line that enables shell completion, e.g. `eval "$(v4 completion bash)"`."""
    click.echo(f'eval "$(_V4_COMPLETE={shell}_source v4)"')


def main(argv=None) -> None:
    try:
        # without standalone mode click returns ctx.exit()'s code (--help, --version) instead of raising Exit
        rc = cli.main(args=argv, prog_name="v4", standalone_mode=False)
    except V4Error as e:
        click.echo(e.render(), err=True)
        sys.exit(e.code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    sys.exit(rc if isinstance(rc, int) else 0)
