#!/usr/bin/env bash
# Build the rlfleet images offline-capable: first a wheelhouse (pip wheel, the one
# step that needs a package index), then `docker build` from that wheelhouse alone.
#
#   tools/build_images.sh [--variant cpu|cuda] [--base IMAGE] [--tag-prefix P]
#                         [--wheels-only | --no-wheels] [TARGET ...]
#
#   TARGET      scheduler reward rollout trainer (default: all four)
#   --variant   cpu: torch's +cpu wheel (from $RLFLEET_TORCH_INDEX, default the
#               PyTorch CPU index, or any find-links pip is configured with);
#               cuda: PyPI's torch with its nvidia-* wheels. Default cpu.
#   --base      BASE_IMAGE (default python:3.11-slim-bookworm; any image with python3 3.11)
#   --tag-prefix  images are <prefix><target>:<variant> (default rlfleet/)
#   --wheels-only   make the wheelhouse and stop (carry build/images/<variant> to an
#                   air-gapped machine, then run there with --no-wheels)
#   --no-wheels     use the wheelhouse as it is
#
# Environment: DOCKER (default docker), PYTHON (default .venv/bin/python or python3),
# RLFLEET_TORCH_INDEX, DOCKER_BUILD_ARGS (extra args for docker build).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
variant=cpu
base=python:3.11-slim-bookworm
prefix=rlfleet/
wheels=1
build=1
targets=()
while (($#)); do
    case "$1" in
        --variant) variant="$2"; shift 2 ;;
        --base) base="$2"; shift 2 ;;
        --tag-prefix) prefix="$2"; shift 2 ;;
        --wheels-only) build=0; shift ;;
        --no-wheels) wheels=0; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) targets+=("$1"); shift ;;
    esac
done
case "$variant" in cpu|cuda) ;; *) echo "--variant must be cpu or cuda, not $variant" >&2; exit 2 ;; esac
((${#targets[@]})) || targets=(scheduler reward rollout trainer)

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
house="$root/build/images/$variant"
torch_version="$(sed -n 's/^TORCH_VERSION := //p' "$root/Makefile")"

if ((wheels)); then
    mkdir -p "$house"
    index_args=()
    if [[ "$variant" == cpu ]]; then
        index_args+=(--extra-index-url "${RLFLEET_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}")
        torch_spec="torch==${torch_version}+cpu"
    else
        torch_spec="torch==${torch_version}"
    fi
    echo "== wheelhouse $house ($torch_spec)" >&2
    "$python" -m pip wheel --quiet --wheel-dir "$house" "${index_args[@]}" \
        pip "$torch_spec" "$root[scheduler,reward,rollout,trainer]"
    cp "$root/deploy/healthcheck.py" "$house/healthcheck.py"
fi
[[ -d "$house" ]] || { echo "no wheelhouse at $house: run without --no-wheels first" >&2; exit 1; }
((build)) || exit 0

docker="${DOCKER:-docker}"
for target in "${targets[@]}"; do
    tag="${prefix}${target}:${variant}"
    echo "== $tag (FROM $base)" >&2
    # shellcheck disable=SC2086  # DOCKER_BUILD_ARGS is a list of words
    "$docker" build --file "$root/deploy/Dockerfile" --target "$target" \
        --build-arg "BASE_IMAGE=$base" --tag "$tag" ${DOCKER_BUILD_ARGS:-} "$house"
done
