"""What `nebula` answers a shell's completion script on TAB (`_NEBULA_COMPLETE=complete_<shell>`):
Typer's completion classes for bash, zsh and fish, the zsh one with its quoting fixed.

The zsh script runs `eval $(nebula)` on the answer, `_arguments '*: :(("value":"help"))'`,
and `_arguments` evaluates the double-quoted words again. Typer writes an apostrophe as
`''` and a double quote as `""`, which zsh reads as two strings put together, so
"checkpoint's manifest" reached the menu as "checkpoints manifest". Here each is escaped
for both evaluations.

Not for: the scripts themselves (completions.py) or what is offered (complete.py).
"""

from __future__ import annotations

from typer._click.shell_completion import CompletionItem, add_completion_class
from typer._completion_classes import ZshComplete, _sanitize_help_text, completion_init


def zsh_quoted(text: str) -> str:
    r"""`text` as a double-quoted word of `_arguments`' `((...))` action, inside the single
    quotes of the line the zsh script evaluates: `\`, `"`, `$` and backquotes escaped
    for the inner evaluation, `:` (which ends an item) as `\:`, `'` closed and reopened.

    Example:
        >>> print(zsh_quoted("it's 2: $x"))
        it'\''s 2\\: \$x
    """
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    text = text.replace("`", "\\`").replace(":", "\\\\:")
    return text.replace("'", "'\\''")


class NebulaZshComplete(ZshComplete):
    """Typer's zsh completion, every value and description quoted by `zsh_quoted`."""

    def format_completion(self, item: CompletionItem) -> str:
        value = zsh_quoted(item.value)
        if item.help:
            return f'"{value}":"{zsh_quoted(_sanitize_help_text(item.help))}"'
        return f'"{value}"'


def register() -> None:
    """Register the completion classes (Typer's, then nebula's zsh one in its place)."""
    completion_init()
    add_completion_class(NebulaZshComplete, NebulaZshComplete.name)
