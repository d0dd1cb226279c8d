#!/bin/bash
# Every minor torch of the supported range, not only its two ends (.ci/run checks those): for
# each minor version, the newest patch PyPI offers, with the torchvision pip picks for it (each
# torchvision pins its torch: 0.23 goes with 2.8, and 0.29.2 with 2.15.0), in a fresh venv outside
# the repository; there the tour (.ci/oldest_torch.py: every step ran, or refused in one line
# naming the torch it needs) and the tests whose outcome depends on the torch (test_versions.py,
# test_debugging*.py: the Flight Recorder's records and dump). One row per version in a table.
#
#   bash .ci/every_torch.sh                       # 2.8 ... 2.15, one after the other
#   bash .ci/every_torch.sh 2.8 2.15              # only these
#   VENVS=/somewhere KEEP=1 bash .ci/every_torch.sh   # where the venvs go; keep them afterwards
#   USE_VENV=.venv bash .ci/every_torch.sh 2.14   # a venv that has it already: no install
#
# Each venv is about 5-6 GB (torch's CUDA wheels come along, as for any Linux user) and is
# deleted after its row unless KEEP=1. PIP_CONFIG_FILE=/dev/null and no PIP_FIND_LINKS: pip reads
# no configuration file nor local wheels, so a machine's cap on torch (a constraint in
# /etc/xdg/pip) does not stand in the way and every torch comes from PyPI.
# The results (table.md, one log per version) go to $RESULTS, default $VENVS/every_torch-DATE.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
VENVS=${VENVS:-/work/venvs}
RESULTS=${RESULTS:-$VENVS/every_torch-$(date -u +%Y-%m-%d)}
minors=("$@")
[ ${#minors[@]} -gt 0 ] || minors=(2.8 2.9 2.10 2.11 2.12 2.13 2.14 2.15)
mkdir -p "$VENVS" "$RESULTS"
table=$RESULTS/table.md
if [ ! -s "$table" ]; then
    echo "| torch | torchvision | install | tour (.ci/oldest_torch.py) | test_versions.py, test_debugging.py | minutes |" >"$table"
    echo "| --- | --- | --- | --- | --- | --- |" >>"$table"
fi
echo "commit $(git rev-parse --short HEAD), $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC')" \
    | tee -a "$RESULTS/runs.txt"

for minor in "${minors[@]}"; do
    venv=${USE_VENV:-$VENVS/torch-$minor}
    log=$RESULTS/torch-$minor.log
    start=$SECONDS
    echo "=== torch $minor.* in $venv (log: $log)"
    [ -n "${USE_VENV:-}" ] || { rm -rf "$venv"; python3 -m venv "$venv"; }
    if [ -n "${USE_VENV:-}" ]; then
        echo "(no install: $venv)" >"$log"
    elif ! env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q \
            --no-cache-dir "torch==$minor.*" torchvision -r requirements-test.txt >"$log" 2>&1; then
        echo "| $minor.* | - | failed (see log) | - | - | $(((SECONDS - start) / 60)) |" >>"$table"
        tail -5 "$log"
        rm -rf "$venv"
        continue
    fi
    installed=$((SECONDS - start))
    versions=$("$venv/bin/python" -c 'import torch, torchvision
print(torch.__version__, torchvision.__version__)')
    read -r torch_v vision_v <<<"$versions"
    echo "installed torch $torch_v, torchvision $vision_v in $installed s" | tee -a "$log"
    "$venv/bin/python" .ci/oldest_torch.py >>"$log" 2>&1
    tour_rc=$?
    tour=$(grep -E '^oldest torch [0-9]' "$log" | tail -1 | sed 's/^oldest torch [^:]*: //')
    [ $tour_rc -eq 0 ] || tour="FAILED: $tour"
    "$venv/bin/python" -m pytest tests/test_versions.py tests/test_debugging.py \
        tests/test_debugging_diagnosis.py -q \
        -p no:cacheprovider -rfE >>"$log" 2>&1
    tests=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|^(=+ )?[0-9]+ failed' "$log" | tail -1 | tr -d '=')
    failed=$(grep -E '^FAILED ' "$log" | sed 's/^FAILED tests\///; s/ - .*//' | paste -sd ' ')
    echo "| $torch_v | $vision_v | $installed s | $tour | ${tests# }${failed:+ (failed: $failed)} | $(((SECONDS - start) / 60)) |" \
        | tee -a "$table"
    [ "${KEEP:-0}" = 1 ] || [ -n "${USE_VENV:-}" ] || rm -rf "$venv"
done
cat "$table"
