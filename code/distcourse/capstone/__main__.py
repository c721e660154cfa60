"""``python -m distcourse.capstone [flags]``: the job as a program, on every rank torchrun starts."""

from ..runtime.i18n import script_language, use
from .train import main

if __name__ == "__main__":
    use(script_language())  # a program has no notebook to ask: DISTCOURSE_LANG, or English
    main()
