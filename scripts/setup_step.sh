#!/usr/bin/env bash
# Sourced by setup_env.sh: one setup step that says what it does, logs quietly and talks on failure.
# Needs LOGS (the log folder) set by the caller.

# setup_step NAME WHAT -- COMMAND...: runs COMMAND with its output in $LOGS/NAME.log, timed.
setup_step() {
    local name="$1" what="$2" start rc
    shift 3
    echo "setup: $what" >&2
    start=$SECONDS
    rc=0
    "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "error: setup step '$name' failed (exit $rc); last lines of $LOGS/$name.log:" >&2
        tail -n 30 "$LOGS/$name.log" >&2
        return "$rc"
    fi
    echo "setup:   done in $((SECONDS - start)) s" >&2
}
