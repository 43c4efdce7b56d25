#!/usr/bin/env bash
# Checks the gRPC contracts (proto/) as strictly versioned, with buf (npm
# @bufbuild/buf, which ships the binary; installed under target/tools):
#
# - lint: the rules of proto/buf.yaml (a comment on every rpc, message and
#   field; enum zero values `_UNSPECIFIED`; package = directory = version);
# - breaking: no field removed, renumbered or retyped, no rpc removed or
#   changed, against proto/baseline.json (the contracts as last recorded)
#   and against the previous commit (when the clone has it).
#
#   scripts/check-proto.sh                     the checks (scripts/test.sh runs them)
#   scripts/check-proto.sh --update-baseline   records the tree's contracts as the
#                                              baseline, after an additive change
set -euo pipefail
cd "$(dirname "$0")/.."

version=1.75.0
tools="target/tools/buf-$version"
buf="$tools/node_modules/.bin/buf"
if ! "$buf" --version >/dev/null 2>&1; then
  npm install --silent --no-audit --no-fund --prefix "$tools" "@bufbuild/buf@$version" >/dev/null
fi

if [ "${1:-}" = --update-baseline ]; then
  "$buf" breaking proto --against proto/baseline.json
  "$buf" build proto --exclude-source-info -o "$tools/baseline.json"
  python3 -c 'import json, sys; json.dump(json.load(open(sys.argv[1])), open(sys.argv[2], "w"), indent=1, sort_keys=True); open(sys.argv[2], "a").write("\n")' "$tools/baseline.json" proto/baseline.json
  echo "proto/baseline.json now records the tree's contracts"
  exit
fi

"$buf" lint proto
"$buf" breaking proto --against proto/baseline.json
if git rev-parse --verify --quiet HEAD~1 >/dev/null && git cat-file -e HEAD~1:proto 2>/dev/null; then
  "$buf" breaking proto --against '.git#ref=HEAD~1,subdir=proto'
fi
# The check can fail: a copy of the contracts with one field renumbered
# must be refused against the baseline.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r proto/. "$scratch"
sed -i '0,/^  string model = 2;/s//  string model = 22;/' "$scratch/turbine/router/v1/router.proto"
grep -q '^  string model = 22;' "$scratch/turbine/router/v1/router.proto" || { echo "check-proto.sh: RouteRequest.model moved; point the self-check at another field" >&2; exit 1; }
if "$buf" breaking "$scratch" --against proto/baseline.json >/dev/null 2>&1; then
  echo "buf breaking let a renumbered field through: the contract check checks nothing" >&2
  exit 1
fi
echo "contracts: lint and breaking checks passed"
