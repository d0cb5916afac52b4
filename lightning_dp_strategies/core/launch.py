"""What the Trainer and Fabric strategies share about launching: a clear refusal of a launcher Jupyter cannot run."""

from __future__ import annotations

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.imports import _IS_INTERACTIVE

__all__ = ["check_interactive_launch"]


def check_interactive_launch(
    strategy: object, launcher: object, start_method: str, name: str | None, where: str
) -> None:
    """Refuse, with the fix, a launcher that cannot start processes from Jupyter or an interactive shell.

    ``name`` is the strategy's registered name (its ``_notebook`` variant is suggested) and ``where`` what takes the
    strategy: ``"Trainer"`` or ``"Fabric"``. The Trainer's error is Lightning's ``MisconfigurationException``, as
    for its own strategies; Fabric's a ``RuntimeError``.
    """
    if not _IS_INTERACTIVE or launcher is None or getattr(launcher, "is_interactive_compatible", True):
        return
    kind = type(strategy).__name__
    by_name = f"{where}(strategy='{name}_notebook')` or `" if name else ""
    error = MisconfigurationException if where == "Trainer" else RuntimeError
    raise error(
        f"{kind}(start_method={start_method!r}) cannot launch processes inside Jupyter or an interactive shell. "
        f"Use `{by_name}{kind}(start_method='fork')` there, or run your code as a script."
    )
