"""What `nebula` answers a shell's completion script on TAB (`_NEBULA_COMPLETE=complete_<shell>`):
Typer's completion classes for bash, zsh and fish, the zsh one with its quoting and its
script fixed.

The zsh script runs `eval $(nebula)` on the answer, `_arguments '*: :(("value":"help"))'`,
and `_arguments` evaluates the double-quoted words again. Typer writes an apostrophe as
`''` and a double quote as `""`, which zsh reads as two strings put together, so
"checkpoint's manifest" reached the menu as "checkpoints manifest". Here each is escaped
for both evaluations.

The zsh script (`_nebula`, what `_NEBULA_COMPLETE=source_zsh` prints) is loaded two ways:
compinit autoloads it from $fpath as the function `_nebula` and runs it on the first TAB
(the file's text is that function's body), or a user sources or evals it. Typer's script
only defines `_nebula_completion` and compdefs it, so loaded from $fpath the first TAB of
each new shell completed nothing; `ZSH_SCRIPT` completes at once when it runs as a
function, and registers itself when it is sourced.

Not for: writing the scripts into the package (completions.py) or what is offered
(complete.py).
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


# Typer's COMPLETION_SCRIPT_ZSH, and then: run as a function (compinit's autoload of
# _nebula: "loadautofunc" on the first TAB, "shfunc" after), complete now; sourced or
# eval'd, register for the TABs to come.
ZSH_SCRIPT = """
#compdef %(prog_name)s

%(complete_func)s() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" %(autocomplete_var)s=complete_zsh %(prog_name)s)
}

if [[ $zsh_eval_context[-1] == (loadautofunc|shfunc) ]]; then
  %(complete_func)s "$@"
else
  compdef %(complete_func)s %(prog_name)s
fi
"""  # noqa: E501 (the script's line, as Typer writes it)


class NebulaZshComplete(ZshComplete):
    """Typer's zsh completion, every value and description quoted by `zsh_quoted`, its
    script `ZSH_SCRIPT`."""

    source_template = ZSH_SCRIPT

    def format_completion(self, item: CompletionItem) -> str:
        value = zsh_quoted(item.value)
        if item.help:
            return f'"{value}":"{zsh_quoted(_sanitize_help_text(item.help))}"'
        return f'"{value}"'


def register() -> None:
    """Register the completion classes (Typer's, then nebula's zsh one in its place)."""
    completion_init()
    add_completion_class(NebulaZshComplete, NebulaZshComplete.name)
