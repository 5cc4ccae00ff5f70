"""``fxpipe show``: look at a plan and its schedule (HTML page, terminal view, Graphviz)."""
