"""One-off investigations (README.md): each answered a question; the tools users run are in bench/."""
