#!/bin/sh
# Entry point of the stof-tvm tuning image: `docker run IMAGE tune ...` runs `stof-tvm tune ...`.
#
# - no arguments: stof-tvm's help;
# - first argument an option or a stof-tvm subcommand (anything that is not a program on PATH): stof-tvm with
#   all the arguments;
# - first argument a program on PATH (sh, python3, nvidia-smi, ...): that program, for looking inside the image.
#
# Either way the command replaces this shell (exec), so the signals docker sends reach it directly: the image's
# stop signal is SIGINT, which stof-tvm turns into a clean stop that keeps every finished tuning record.
set -eu

STOF_TVM="${STOF_TVM:-stof-tvm}"

if [ "$#" -eq 0 ]; then
    exec "$STOF_TVM" --help
fi

case "$1" in
    -*) exec "$STOF_TVM" "$@" ;;
esac

if command -v -- "$1" >/dev/null 2>&1; then
    exec "$@"
fi

exec "$STOF_TVM" "$@"
