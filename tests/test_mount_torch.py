"""torchvision ImageFolder and a multi-worker DataLoader over a real mount, unchanged."""

from __future__ import annotations

import pytest

from tests.conftest import Mounter, brace
from tests.test_mount import publish

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("torchvision.datasets")
transforms = pytest.importorskip("torchvision.transforms")


def test_imagefolder_same_samples_and_targets(dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")])
    local = datasets.ImageFolder(str(dataset.root / "train"))
    mounted = datasets.ImageFolder(str(m.mountpoint / "train"))
    assert mounted.classes == local.classes
    assert mounted.class_to_idx == local.class_to_idx
    strip = len(str(dataset.root / "train"))
    strip_m = len(str(m.mountpoint / "train"))
    assert [(p[strip_m:], t) for p, t in mounted.samples] == \
        [(p[strip:], t) for p, t in local.samples]
    # Decoded images are identical too.
    for i in (0, len(local) // 2, len(local) - 1):
        a, ta = local[i]
        b, tb = mounted[i]
        assert ta == tb and a.tobytes() == b.tobytes()


# 4 worker processes on purpose (more than this machine's cores: readers wait on I/O).
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_dataloader_epoch_with_workers(dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm")
    tf = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
    ds = datasets.ImageFolder(str(m.mountpoint / "train"), transform=tf)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=4)
    seen = 0
    labels = []
    for images, targets in loader:
        assert images.shape[1:] == (3, 32, 32)
        seen += images.shape[0]
        labels.extend(targets.tolist())
    assert seen == len(ds)
    assert sorted(labels) == sorted(t for _, t in ds.samples)
    stats = m.stats()
    assert stats["reader"]["eio"] == 0
    tar_requests = [r for r in nginx.access_log() if r.uri.endswith(".tar")]
    # Whole-shard streaming: far fewer requests than files.
    assert len(tar_requests) < len(ds) // 2
