#!/usr/bin/env bash
# Download COCO 2017 (train/val images, train/val annotations), verify the MD5 of each archive and extract
# them into the layout CocoDALIDataModule reads (data.root=<root>):
#
#   <root>/train2017/*.jpg  <root>/val2017/*.jpg  <root>/annotations/instances_{train,val}2017.json
#
# Run `scripts/download_coco.sh --help` for the options. Needs curl or wget, md5sum (or python3), and
# unzip (or python3). Sizes: train2017.zip 18.0 GiB, val2017.zip 778 MiB, annotations 241 MiB; about
# the same again once extracted.
set -euo pipefail

BASE_URL=${COCO_BASE_URL:-http://images.cocodataset.org}

# The MD5s published with the archives (the S3 ETags of images.cocodataset.org), with their sizes in bytes:
# train2017.zip 19336861798, val2017.zip 815585330, annotations_trainval2017.zip 252907541.
DEFAULT_MD5S="cced6f7f71b7629ddf16f17bbcfab6b2  train2017.zip
442b8da7639aecaf257c1dceb8ba8c80  val2017.zip
f4bbac642086de4f52a3fdda2de5fa2c  annotations_trainval2017.zip"

usage() {
    cat <<'EOF'
Usage: scripts/download_coco.sh [options] [ROOT]

Download COCO 2017 into ROOT (default: ./data/coco), verify each archive's MD5, extract it and leave
  ROOT/train2017/  ROOT/val2017/  ROOT/annotations/instances_{train,val}2017.json
Then train with:  python train.py experiment=ssd300_fp16_8gpu data.root=ROOT

Options:
  --parts LIST         comma-separated subset of train,val,annotations (default: all three;
                       evaluation alone needs val,annotations)
  --download-dir DIR   where the .zip archives go (default: ROOT/downloads)
  --md5-file FILE      checksums to verify against, in md5sum format ("<md5>  <file name>");
                       default: the published MD5s built into this script (env: COCO_MD5_FILE)
  --delete-archives    delete each archive once it has been extracted
  -h, --help           show this help

Re-running is safe: a part whose directory already exists is skipped, an interrupted download resumes
where it stopped, and an archive whose MD5 does not match is deleted with an error. Each archive is
extracted into a hidden temporary directory under ROOT and renamed into place only when complete, so
ROOT/train2017, ROOT/val2017 and ROOT/annotations either are complete or do not exist.

Environment:
  COCO_BASE_URL     server to download from (default: http://images.cocodataset.org); archives are
                    fetched from $COCO_BASE_URL/zips/{train,val}2017.zip and
                    $COCO_BASE_URL/annotations/annotations_trainval2017.zip
  COCO_MD5_FILE     as --md5-file
  COCO_DOWNLOADER   curl or wget (default: curl if installed, else wget)
EOF
}

die() {
    echo "download_coco.sh: error: $*" >&2
    exit 1
}

log() {
    echo "download_coco.sh: $*" >&2
}

# ---------------------------------------------------------------------------------------------------- args
ROOT=
PARTS=train,val,annotations
DOWNLOAD_DIR=
MD5_FILE=${COCO_MD5_FILE:-}
DELETE_ARCHIVES=0
while [ $# -gt 0 ]; do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --parts)
            [ $# -ge 2 ] || die "--parts needs a value"
            PARTS=$2
            shift 2
            ;;
        --download-dir)
            [ $# -ge 2 ] || die "--download-dir needs a value"
            DOWNLOAD_DIR=$2
            shift 2
            ;;
        --md5-file)
            [ $# -ge 2 ] || die "--md5-file needs a value"
            MD5_FILE=$2
            shift 2
            ;;
        --delete-archives)
            DELETE_ARCHIVES=1
            shift
            ;;
        -*) die "unknown option $1 (see --help)" ;;
        *)
            [ -z "$ROOT" ] || die "only one ROOT directory may be given (got '$ROOT' and '$1')"
            ROOT=$1
            shift
            ;;
    esac
done
ROOT=${ROOT:-./data/coco}
DOWNLOAD_DIR=${DOWNLOAD_DIR:-$ROOT/downloads}

# part -> archive name, URL path, directory it creates in ROOT
archive_of() {
    case "$1" in
        train) echo train2017.zip ;;
        val) echo val2017.zip ;;
        annotations) echo annotations_trainval2017.zip ;;
        *) die "unknown part '$1' in --parts (expected train, val, annotations)" ;;
    esac
}
url_of() {
    case "$1" in
        annotations) echo "$BASE_URL/annotations/$(archive_of "$1")" ;;
        *) echo "$BASE_URL/zips/$(archive_of "$1")" ;;
    esac
}
dir_of() {
    case "$1" in
        train) echo train2017 ;;
        val) echo val2017 ;;
        annotations) echo annotations ;;
    esac
}

IFS=, read -r -a PART_LIST <<<"$PARTS"
[ ${#PART_LIST[@]} -gt 0 ] || die "--parts is empty"
for part in "${PART_LIST[@]}"; do
    archive_of "$part" >/dev/null
done

if [ -n "$MD5_FILE" ]; then
    [ -f "$MD5_FILE" ] || die "checksum file $MD5_FILE does not exist"
    MD5S=$(cat "$MD5_FILE")
else
    MD5S=$DEFAULT_MD5S
fi

# The expected MD5 of an archive; a missing or malformed entry is an error, never a skipped check.
expected_md5() {
    local name=$1 sum
    sum=$(awk -v f="$name" '{ n = $2; sub(/^\*/, "", n) } n == f { print tolower($1); exit }' <<<"$MD5S")
    [ -n "$sum" ] || die "no MD5 for $name in ${MD5_FILE:-the built-in table}: refusing to use an unverified archive"
    [[ "$sum" =~ ^[0-9a-f]{32}$ ]] || die "the MD5 for $name ('$sum') is not 32 hexadecimal digits"
    echo "$sum"
}

# ---------------------------------------------------------------------------------------------------- tools
DOWNLOADER=${COCO_DOWNLOADER:-}
if [ -z "$DOWNLOADER" ]; then
    if command -v curl >/dev/null; then
        DOWNLOADER=curl
    elif command -v wget >/dev/null; then
        DOWNLOADER=wget
    else
        die "neither curl nor wget is installed"
    fi
fi
case "$DOWNLOADER" in
    curl | wget) command -v "$DOWNLOADER" >/dev/null || die "COCO_DOWNLOADER=$DOWNLOADER is not installed" ;;
    *) die "COCO_DOWNLOADER must be curl or wget, not '$DOWNLOADER'" ;;
esac

md5_of() {
    if command -v md5sum >/dev/null; then
        md5sum "$1" | awk '{ print $1 }'
    else
        python3 - "$1" <<'EOF'
import hashlib, sys
h = hashlib.md5()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())
EOF
    fi
}

extract() { # extract ZIP into the existing directory DEST
    if command -v unzip >/dev/null; then
        unzip -q "$1" -d "$2"
    else
        python3 -m zipfile -e "$1" "$2"
    fi
}

# Download URL to FILE, resuming a partial FILE. A server that cannot resume gets a fresh download.
download() {
    local url=$1 file=$2 rc=0 status
    log "downloading $url"
    if [ "$DOWNLOADER" = curl ]; then
        status=$(curl --fail --location --retry 5 --retry-delay 5 --continue-at - --output "$file" \
            --write-out '%{http_code}' "$url") || rc=$?
        if [ "$rc" -eq 22 ] && [ "$status" = 416 ] && [ -s "$file" ]; then
            rc=0 # range not satisfiable: the file is already whole (the MD5 check comes next)
        elif [ "$rc" -eq 33 ]; then # HTTP server doesn't support byte ranges
            log "the server cannot resume $url: downloading it again from the start"
            rm -f "$file"
            rc=0
            curl --fail --location --retry 5 --retry-delay 5 --output "$file" "$url" || rc=$?
        fi
    else
        wget --continue --tries=5 --output-document="$file" "$url" || rc=$?
    fi
    [ "$rc" -eq 0 ] || die "download of $url failed ($DOWNLOADER exit status $rc); run again to resume"
}

# ---------------------------------------------------------------------------------------------------- main
TMP_DIRS=()
cleanup() {
    local d
    for d in ${TMP_DIRS[@]+"${TMP_DIRS[@]}"}; do
        rm -rf "$d"
    done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$ROOT" "$DOWNLOAD_DIR"

TODO=()
for part in "${PART_LIST[@]}"; do
    if [ -d "$ROOT/$(dir_of "$part")" ]; then
        log "$ROOT/$(dir_of "$part") exists: skipping $part"
    else
        TODO+=("$part")
    fi
done

# 1. download everything, 2. verify everything, 3. extract: a bad archive stops the run before any
# directory appears in ROOT.
for part in ${TODO[@]+"${TODO[@]}"}; do
    expected_md5 "$(archive_of "$part")" >/dev/null # a missing checksum fails before any download
done
for part in ${TODO[@]+"${TODO[@]}"}; do
    download "$(url_of "$part")" "$DOWNLOAD_DIR/$(archive_of "$part")"
done
for part in ${TODO[@]+"${TODO[@]}"}; do
    archive=$DOWNLOAD_DIR/$(archive_of "$part")
    expected=$(expected_md5 "$(archive_of "$part")")
    log "verifying $archive"
    actual=$(md5_of "$archive")
    if [ "$actual" != "$expected" ]; then
        rm -f "$archive"
        die "MD5 mismatch for $archive: expected $expected, got $actual. The archive was deleted; run again to download it from the start."
    fi
done
for part in ${TODO[@]+"${TODO[@]}"}; do
    archive=$DOWNLOAD_DIR/$(archive_of "$part")
    name=$(dir_of "$part")
    tmp=$(mktemp -d "$ROOT/.extract-$name.XXXXXX")
    TMP_DIRS+=("$tmp")
    log "extracting $archive"
    extract "$archive" "$tmp" || die "extracting $archive failed; nothing was written to $ROOT/$name"
    [ -d "$tmp/$name" ] || die "$archive has no top-level $name/ directory"
    if [ "$part" = annotations ]; then
        for split in train val; do
            [ -f "$tmp/annotations/instances_${split}2017.json" ] ||
                die "$archive has no annotations/instances_${split}2017.json"
        done
    fi
    mv "$tmp/$name" "$ROOT/$name"
    rm -rf "$tmp"
    [ "$DELETE_ARCHIVES" -eq 0 ] || rm -f "$archive"
done

for part in "${PART_LIST[@]}"; do
    [ -d "$ROOT/$(dir_of "$part")" ] || die "$ROOT/$(dir_of "$part") is missing after the run"
done
log "done: $ROOT has ${PART_LIST[*]}; train with data.root=$ROOT"
