#!/bin/sh
# Print the path of a uv binary for `make demo`, fetching it into var/uv on first use;
# print nothing (pip then installs) if it cannot be had.
cd "$(dirname "$0")/.." || exit 0
if [ ! -x var/uv/bin/uv ]; then
  "${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --target var/uv uv \
    >/dev/null 2>&1 || exit 0
fi
[ -x var/uv/bin/uv ] && echo "$PWD/var/uv/bin/uv"
exit 0
