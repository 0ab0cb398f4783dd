"""The ``adaloss`` command: a thin click group whose subcommands are imported only when used.

Exit codes: 0 success, 1 runtime failure, 2 user error (bad config, bad option, missing data), 128 + N when stopped
by signal N (141 when the reader of stdout went away). Tracebacks are shown only with ``--debug``.
"""

from __future__ import annotations

import importlib
import io
import os
import signal
import sys

import click

from adaloss import __version__
from adaloss.errors import AdalossError
from adaloss_cli.signals import signal_of, sigterm_raises

# command name -> (module, function, one-line help shown in `adaloss --help`)
COMMANDS = {
    "train": ("adaloss_cli.commands.train", "train", "Train one experiment from a YAML config."),
    "validate": ("adaloss_cli.commands.validate", "validate", "Check config and sweep files without training."),
    "compare": ("adaloss_cli.commands.compare", "compare",
                "Run one config once per loss-scaling method and seed; table and plots side by side."),
    "batch": ("adaloss_cli.commands.batch", "batch",
              "Run a sweep file's grid or list of overrides, resumably; aggregated table."),
    "report": ("adaloss_cli.commands.report", "report",
               "Rebuild tables and plots from run, comparison or sweep directories (no training)."),
    "configs": ("adaloss_cli.commands.configs", "configs",
                "List the shipped experiment configs and sweeps by name, or print one."),
    "env": ("adaloss_cli.commands.env", "env", "Print versions, backends and devices (for bug reports)."),
}

# ctx.meta key holding the arguments `adaloss` was invoked with (after the program name).
ARGV_KEY = "adaloss.argv"


class ReportedError(click.ClickException):
    """An adaloss error shown as ``Error: <message>`` with its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not hit the closed pipe again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # not a real file (tests capture it): nothing to flush
        pass


class LazyGroup(click.Group):
    """A group that imports a subcommand's module only when that subcommand runs."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Kept for meta.json: sys.argv is someone else's command line when adaloss is invoked in-process.
        ctx.meta[ARGV_KEY] = list(args)
        return super().parse_args(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def invoke(self, ctx: click.Context):
        """Run the subcommand; adaloss errors become one-line messages with exit code 2 (user) or 1 (runtime), and
        SIGINT or SIGTERM (even while the subcommand is still being imported) exit code 128 + the signal."""
        try:
            with sigterm_raises():
                return super().invoke(ctx)
        except AdalossError as err:
            if (ctx.obj or {}).get("debug"):
                raise
            raise ReportedError(str(err), err.exit_code) from None
        except KeyboardInterrupt as interrupt:
            if (ctx.obj or {}).get("debug"):
                raise
            signum = signal_of(interrupt)
            raise ReportedError(f"stopped by {signal.Signals(signum).name}", 128 + signum) from None
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except BrokenPipeError:  # the reader went away (`adaloss env | head -1`): stop quietly, as Unix tools do
            _discard_stdout()
            raise click.exceptions.Exit(128 + signal.SIGPIPE) from None
        except Exception as err:  # a bug, not a user mistake: say so, keep the traceback behind --debug
            if (ctx.obj or {}).get("debug"):
                raise
            raise ReportedError(f"internal error {type(err).__name__}: {err} (re-run with --debug for the "
                                "traceback)", 1) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_, _, help_) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="adaloss")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Train with fp16 mixed precision and none, fixed, dynamic or adaptive per-layer loss scaling.

    A config or sweep file is a YAML path or the name of a shipped one (`adaloss configs` lists them).

    \b
    Examples:
      adaloss configs
      adaloss train --config digits
      adaloss train --config digits --set loss_scaling.method=fixed --set precision.dtype=float16
      adaloss compare fp32 none fixed dynamic adaptive --config digits
      adaloss batch sweeps/digits --jobs 2
      adaloss train --resume runs/digits-cnn-dynamic-20261121-120000
      adaloss validate digits sweeps/digits
      adaloss env
    """
    ctx.obj = {"debug": debug}


def main() -> None:
    """Console entry point.

    A process that ``adaloss train --nproc-per-node`` started leaves with ``os._exit`` once its command has
    returned and its output is flushed: the run's files are closed and the process group destroyed by then, and
    the interpreter's own teardown is where gloo's threads were seen, rarely, to abort the process ("terminate
    called without an active exception"), which failed a finished run."""
    if "LOCAL_RANK" not in os.environ:
        cli(prog_name="adaloss")
        return
    from adaloss_cli.distributed import COMMAND_ENV  # (only here: it imports NumPy, which plain commands need not)

    if os.environ.get(COMMAND_ENV) is None:  # started by the user's own torchrun: its usual exit
        cli(prog_name="adaloss")
        return
    code: int | str | None = 0
    try:
        cli(prog_name="adaloss")
    except SystemExit as leaving:
        code = leaving.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
