

import sdforge  # noqa: F401  (first: silences known library messages before any import logs them)
