"""Running studies on clusters: Slurm batch scripts rendered from a study and a launch config (``slurm``),
``megaopd submit`` (``submit``), and the small jobs around the stages (``jobs``: assets, report).

The hand-editable script templates are in ``slurm/`` at the top of the checkout; ``launchers/`` has the
nemo-run version of the same study, and ``docs/cluster.md`` the how-to.
"""
