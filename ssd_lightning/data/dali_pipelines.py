"""DALI pipeline graphs for SSD300 (COCO) and ImageFolder classification.

``device="gpu"`` only moves the decoder ("mixed") and the image operators ("gpu"); box operators run on the
CPU. Readers are named ``"Reader"``, pad the last batch of a shard with copies of its last sample and never
change shard between epochs (docs/internals.md). Outputs (per sample):

* ``coco_train_pipeline``: image (3, S, S) float, boxes (8732, 4) float32 (cx, cy, w, h) in [0, 1] (unmatched
  default boxes carry themselves), labels (8732,) int32 contiguous (0 = background); optionally image id.
* ``coco_val_pipeline``: image (3, S, S), image id (1,) int32, original (height, width) (2,) int64.
* ``classification_*_pipeline``: image (3, S, S), label (1,) int32.
"""

from __future__ import annotations

from collections.abc import Sequence

from nvidia.dali import fn, pipeline_def, types

from ssd_lightning.data.dali_compat import reader_shuffle_kwargs
from ssd_lightning.models.registry import IMAGENET_MEAN, IMAGENET_STD


def _devices(device: str) -> tuple[str, str]:
    """(decoder device, image-op device) for a resolved ``"cpu"``/``"gpu"``."""
    return ("mixed", "gpu") if device == "gpu" else ("cpu", "cpu")


def _normalize(images, *, dtype: types.DALIDataType, device: str, **kwargs):  # kwargs: crop, mirror
    mean, std = list(IMAGENET_MEAN), list(IMAGENET_STD)
    return fn.crop_mirror_normalize(
        images, device=device, mean=mean, std=std, dtype=dtype, output_layout="CHW", **kwargs
    )


def _reader(read, shard_id: int, num_shards: int, shuffle: bool = False, seed: int = 0, **kwargs):
    """``read`` (a DALI reader) named ``"Reader"``, padding the last batch of its shard; ``shuffle``: one
    global reshuffle per epoch (the same order on every rank), else a fixed shard."""
    order = reader_shuffle_kwargs(seed) if shuffle else {"stick_to_shard": True}
    return read(
        name="Reader", shard_id=shard_id, num_shards=num_shards, pad_last_batch=True, **order, **kwargs
    )


def _coco_reader(file_root: str, annotations_file: str, *args, **kwargs):
    """``fn.readers.coco`` of relative ltrb boxes, through :func:`_reader` (which takes ``args``)."""
    files = dict(file_root=file_root, annotations_file=annotations_file, ltrb=True, ratio=True)
    return _reader(fn.readers.coco, *args, **files, **kwargs)


def _decode_resize(jpegs, decoder_device: str, image_device: str, image_size: int):
    images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB)
    return fn.resize(images, resize_x=image_size, resize_y=image_size, device=image_device)


def _ssd_augment(jpegs, bboxes, labels, decoder_device: str, image_device: str, image_size: int):
    """NVIDIA's SSD300 augmentation: IoU-constrained random crop (decoded as a slice), flip p=0.5, resize,
    colour jitter; returns (images uint8, ltrb boxes, labels)."""
    crop_begin, crop_size, bboxes, labels = fn.random_bbox_crop(
        bboxes,
        labels,
        aspect_ratio=[0.5, 2.0],
        thresholds=[0.0, 0.1, 0.3, 0.5, 0.7, 0.9],
        scaling=[0.3, 1.0],
        bbox_layout="xyXY",
        allow_no_crop=True,
        num_attempts=1,
    )
    images = fn.decoders.image_slice(
        jpegs, crop_begin, crop_size, device=decoder_device, output_type=types.RGB
    )
    flip = fn.random.coin_flip(probability=0.5)
    images = fn.flip(images, horizontal=flip, device=image_device)
    bboxes = fn.bb_flip(bboxes, horizontal=flip, ltrb=True)
    images = fn.resize(images, resize_x=image_size, resize_y=image_size, device=image_device)
    # hue is in degrees in DALI; U[-0.5, 0.5] is the reference's value (a very mild jitter).
    images = fn.hsv(
        images,
        hue=fn.random.uniform(range=[-0.5, 0.5]),
        saturation=fn.random.uniform(range=[0.5, 1.5]),
        dtype=types.FLOAT,  # float keeps the intermediate from clipping/quantising
        device=image_device,
    )
    images = fn.brightness_contrast(
        images,
        brightness=fn.random.uniform(range=[0.875, 1.125]),
        contrast=fn.random.uniform(range=[0.5, 1.5]),
        contrast_center=128,
        dtype=types.UINT8,
        device=image_device,
    )
    return images, bboxes, labels


@pipeline_def
def coco_train_pipeline(
    *,
    file_root: str,
    annotations_file: str,
    anchors_ltrb: Sequence[float],
    shard_id: int = 0,
    num_shards: int = 1,
    shuffle: bool = True,
    shuffle_seed: int = 42,
    device: str = "cpu",
    dtype: types.DALIDataType = types.FLOAT,
    image_size: int = 300,
    augment: bool = True,
    include_crowd: bool = True,
    output_image_ids: bool = False,
):
    """SSD300 training graph (NVIDIA reference augmentation; ``augment=False``: decode + resize only) over
    the images with boxes. ``anchors_ltrb``: the default boxes, flat ltrb (``dboxes300_coco().ltrb``).
    ``include_crowd``: crowd boxes as ordinary boxes, as in the reference (``include_iscrowd`` is True there).
    """
    decoder_device, image_device = _devices(device)
    jpegs, bboxes, labels, *image_ids = _coco_reader(
        file_root,
        annotations_file,
        shard_id,
        num_shards,
        shuffle,
        shuffle_seed,
        skip_empty=True,
        include_iscrowd=include_crowd,
        image_ids=output_image_ids,
    )
    if augment:
        images, bboxes, labels = _ssd_augment(jpegs, bboxes, labels, decoder_device, image_device, image_size)
    else:
        images = _decode_resize(jpegs, decoder_device, image_device, image_size)
    images = _normalize(images, dtype=dtype, device=image_device)
    bboxes, labels = fn.box_encoder(bboxes, labels, criteria=0.5, anchors=list(anchors_ltrb))
    if device == "gpu":
        bboxes, labels = bboxes.gpu(), labels.gpu()
    return images, bboxes, labels, *image_ids


@pipeline_def
def coco_val_pipeline(
    *,
    file_root: str,
    annotations_file: str,
    shard_id: int = 0,
    num_shards: int = 1,
    device: str = "cpu",
    dtype: types.DALIDataType = types.FLOAT,
    image_size: int = 300,
    skip_empty: bool = False,
):
    """Validation graph: every image once per shard (``skip_empty``: only those with boxes, NVIDIA's
    protocol), decode RGB, resize, normalise."""
    decoder_device, image_device = _devices(device)
    jpegs, _, _, image_ids = _coco_reader(
        file_root, annotations_file, shard_id, num_shards, skip_empty=skip_empty, image_ids=True
    )
    # (H, W, C) of the original, read from the encoded header on the CPU: the shape of a GPU-decoded image
    # would be a GPU->CPU transition, which only DALI's dynamic executor (2.x) can build.
    sizes = fn.peek_image_shape(jpegs, dtype=types.INT64)[0:2]
    images = _decode_resize(jpegs, decoder_device, image_device, image_size)
    return _normalize(images, dtype=dtype, device=image_device), image_ids, sizes


@pipeline_def
def classification_train_pipeline(
    *,
    file_root: str,
    shard_id: int = 0,
    num_shards: int = 1,
    shuffle: bool = True,
    shuffle_seed: int = 42,
    device: str = "cpu",
    dtype: types.DALIDataType = types.FLOAT,
    image_size: int = 224,
):
    """Random-resized crop (area 0.08-1, aspect 3/4-4/3), resize, flip p=0.5, normalise."""
    decoder_device, image_device = _devices(device)
    jpegs, labels = _reader(fn.readers.file, shard_id, num_shards, shuffle, shuffle_seed, file_root=file_root)
    images = fn.decoders.image_random_crop(
        jpegs,
        device=decoder_device,
        output_type=types.RGB,
        random_area=[0.08, 1.0],
        random_aspect_ratio=[3 / 4, 4 / 3],
        num_attempts=100,
    )
    images = fn.resize(images, resize_x=image_size, resize_y=image_size, device=image_device)
    images = _normalize(images, dtype=dtype, device=image_device, mirror=fn.random.coin_flip(probability=0.5))
    return images, labels.gpu() if device == "gpu" else labels


@pipeline_def
def classification_val_pipeline(
    *,
    file_root: str,
    shard_id: int = 0,
    num_shards: int = 1,
    device: str = "cpu",
    dtype: types.DALIDataType = types.FLOAT,
    image_size: int = 224,
    resize_size: int = 256,
):
    """Resize the shorter side to ``resize_size``, centre-crop ``image_size``, normalise."""
    decoder_device, image_device = _devices(device)
    jpegs, labels = _reader(fn.readers.file, shard_id, num_shards, file_root=file_root)
    images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB)
    images = fn.resize(images, resize_shorter=resize_size, device=image_device)
    images = _normalize(images, dtype=dtype, device=image_device, crop=(image_size, image_size))
    return images, labels.gpu() if device == "gpu" else labels
