"""The operator's dashboard at ``/ui``: server-rendered HTML and inline SVG.

Read-only, no JavaScript, no build step. ``routes`` (pages and auth),
``service`` (the pages' views, in ``views``, assembled from the catalog),
``repository`` (the catalog queries behind them), ``svg`` (timeline and
lineage graph), ``templates`` (Jinja2 templates kept as Python strings, so a
plain ``pip install`` ships them).
"""
