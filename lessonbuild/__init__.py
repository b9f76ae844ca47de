"""The lessons' build tooling: run the notebooks headless (``runner``) and build their Arabic
edition (``edition``). It ships with the repository, not inside the ``nbaccel`` package, and
runs from the repository root::

    python -m lessonbuild.runner demo        # make demo
    python -m lessonbuild.runner lessons     # make lessons
    python -m lessonbuild.edition check      # translations missing or out of date
"""
