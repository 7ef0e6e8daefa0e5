/*
 * Reads of members the lookahead holds in its shared arena, answered in C (part of _shim.c,
 * #included by _shim_meta.c; shardfs/fuse/arenareads.py is the Python side).
 *
 * With FUSE workers, `shardfs.torch.Lookahead`'s members wait in a memfd the daemon fills
 * (shardfs/read/arena.py) and every worker maps; the daemon tells each worker where a member
 * landed (shard, member offset -> arena offset, generation). Served by pyfuse3's loop, such a
 * READ cost a worker a few hundred microseconds of Python on 2 cores; here it costs a table
 * lookup and a copy. The worker's Python puts what it is told in the table below, and a READ
 * of a member in it is copied out of this process's read-only mapping if the generation of
 * the member's first block is the one told, before and after the copy (a freed, let alone
 * reused, place is never served: the same check as ArenaView.copy). Each read served here is
 * recorded in `taken`, which Python collects and reports to the daemon (it frees members
 * once read and fetches on); when `taken` is full, reads go to Python until it is collected.
 *
 * The table and `taken` are changed by Python (arenareads.py) and read by whichever thread
 * answers a READ (pyfuse3's, or the reader thread of _shim_reader.c): both sides hold
 * `serve_mu` while they do (Python through shim.paused()). Members that landed are the
 * exception: Python appends them to `arena_landed` under a lock of its own, held only for the
 * append, and whoever next looks the table up under `serve_mu` moves them in. A landing needs
 * no READ in progress to finish first (waiting for the serving lock held the daemon's loop
 * ~0.2 s of a 3.6 s `Lookahead` epoch: docs/benchmarks-notes.md, "Landed members told
 * without waiting"); a member leaving does, as its bytes are about to be reused.
 */
#include <sys/mman.h>

#define ARENA_BLOCK 4096   /* arena.py's BLOCK */

struct arena_slot {
    uint64_t shard_plus1;   /* 0: an empty slot */
    uint64_t member_off;
    uint64_t at;            /* arena offset of the member's first byte */
    uint64_t gen;           /* generation of its first block when it landed */
};

static struct arena_slot *arena_tab;
static uint64_t arena_mask, arena_count;   /* table size - 1 (a power of two), slots used */
static const char *arena_data;             /* the mapping: data blocks, then generations */
static const uint64_t *arena_gens;
static uint64_t arena_size, arena_total;
static uint64_t *arena_taken;              /* 4 per read: shard, member off, arena off, bytes */
static uint64_t arena_taken_cap, *arena_taken_len;
/* Members that landed, not yet in the table: 4 uint64 each (shard, member off, at, gen). */
static pthread_mutex_t arena_landed_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t *arena_landed, arena_landed_cap;
static uint64_t arena_landed_len;   /* read without the lock as a hint (atomic) */

static uint64_t arena_home(uint64_t shard_plus1, uint64_t member_off)
{
    uint64_t h = shard_plus1 * 0x9E3779B97F4A7C15ull ^ member_off * 0xC2B2AE3D27D4EB4Full;
    return (h ^ (h >> 29)) & arena_mask;
}

static struct arena_slot *arena_find(uint64_t shard_plus1, uint64_t member_off)
{
    if (arena_tab == NULL)
        return NULL;
    for (uint64_t i = arena_home(shard_plus1, member_off);; i = (i + 1) & arena_mask) {
        struct arena_slot *e = &arena_tab[i];
        if (e->shard_plus1 == 0)
            return NULL;
        if (e->shard_plus1 == shard_plus1 && e->member_off == member_off)
            return e;
    }
}

/* Remove a slot of the table (linear probing: the run behind it shifts back, no tombstones). */
static void arena_remove(struct arena_slot *e)
{
    uint64_t hole = (uint64_t)(e - arena_tab);
    for (uint64_t j = (hole + 1) & arena_mask; arena_tab[j].shard_plus1 != 0;
         j = (j + 1) & arena_mask) {
        uint64_t home = arena_home(arena_tab[j].shard_plus1, arena_tab[j].member_off);
        /* j's entry may fill the hole unless its home lies cyclically in (hole, j]. */
        int stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            arena_tab[hole] = arena_tab[j];
            hole = j;
        }
    }
    arena_tab[hole].shard_plus1 = 0;
    arena_count--;
}

static int arena_grow(void)
{
    uint64_t old_size = arena_tab == NULL ? 0 : arena_mask + 1;
    uint64_t size = old_size == 0 ? 1024 : 2 * old_size;
    struct arena_slot *old = arena_tab, *tab = calloc(size, sizeof(*tab));
    if (tab == NULL)
        return -ENOMEM;
    arena_tab = tab;
    arena_mask = size - 1;
    arena_count = 0;
    for (uint64_t i = 0; i < old_size; i++) {
        if (old[i].shard_plus1 == 0)
            continue;
        uint64_t j = arena_home(old[i].shard_plus1, old[i].member_off);
        while (tab[j].shard_plus1 != 0)
            j = (j + 1) & arena_mask;
        tab[j] = old[i];
        arena_count++;
    }
    free(old);
    return 0;
}

/* Map the daemon's arena (`fd`: opened through /proc; `total` bytes, `size` of them data) and
 * where to record reads served here: `taken` holds `cap` records of 4 uint64, `*taken_len`
 * of them used (Python empties it). Forgets every member of an earlier mapping. */
int shardfs_shim_arena_map(int fd, uint64_t total, uint64_t size, uint64_t *taken,
                           uint64_t cap, uint64_t *taken_len)
{
    if (size > total || size % ARENA_BLOCK || taken == NULL || taken_len == NULL)
        return -EINVAL;
    void *map = mmap(NULL, total, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED)
        return -errno;
    if (arena_data != NULL)
        munmap((void *)arena_data, arena_total);
    if (arena_tab != NULL)
        memset(arena_tab, 0, (arena_mask + 1) * sizeof(*arena_tab));
    arena_count = 0;
    pthread_mutex_lock(&arena_landed_mu);   /* landings told for the mapping before */
    __atomic_store_n(&arena_landed_len, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&arena_landed_mu);
    arena_data = map;
    arena_gens = (const uint64_t *)(arena_data + size);
    arena_size = size;
    arena_total = total;
    arena_taken = taken;
    arena_taken_cap = cap;
    arena_taken_len = taken_len;
    return 0;
}

/* A member landed at `at` (its first block's generation `gen`). 0, or -errno. With serve_mu. */
static int arena_put(uint32_t shard, uint64_t member_off, uint64_t at, uint64_t gen)
{
    if (arena_data == NULL || at >= arena_size || at % ARENA_BLOCK)
        return -EINVAL;
    if ((arena_count + 1) * 2 > (arena_tab == NULL ? 0 : arena_mask + 1) && arena_grow() != 0)
        return -ENOMEM;
    uint64_t key = (uint64_t)shard + 1;
    uint64_t i = arena_home(key, member_off);
    while (arena_tab[i].shard_plus1 != 0
           && !(arena_tab[i].shard_plus1 == key && arena_tab[i].member_off == member_off))
        i = (i + 1) & arena_mask;
    if (arena_tab[i].shard_plus1 == 0)
        arena_count++;
    arena_tab[i] = (struct arena_slot){key, member_off, at, gen};
    return 0;
}

/* Members that landed (`n` of them, 4 uint64 each: shard, member offset, arena offset,
 * generation), queued for the table without serve_mu. 0, or -ENOMEM (none queued). */
int shardfs_shim_arena_landed(const uint64_t *flat, uint64_t n)
{
    if (n == 0)
        return 0;
    pthread_mutex_lock(&arena_landed_mu);
    uint64_t len = __atomic_load_n(&arena_landed_len, __ATOMIC_RELAXED);
    if (len + n > arena_landed_cap) {
        uint64_t cap = arena_landed_cap ? arena_landed_cap : 256;
        while (cap < len + n)
            cap *= 2;
        uint64_t *grown = realloc(arena_landed, cap * 4 * sizeof(uint64_t));
        if (grown == NULL) {
            pthread_mutex_unlock(&arena_landed_mu);
            return -ENOMEM;
        }
        arena_landed = grown;
        arena_landed_cap = cap;
    }
    memcpy(arena_landed + 4 * len, flat, n * 4 * sizeof(uint64_t));
    __atomic_store_n(&arena_landed_len, len + n, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&arena_landed_mu);
    return 0;
}

/* Move the queued landings into the table (with serve_mu). One that cannot be put (no memory
 * for the table) is left to Python's READ, as a member the table never had. */
static void arena_take_landed(void)
{
    if (__atomic_load_n(&arena_landed_len, __ATOMIC_ACQUIRE) == 0)
        return;
    pthread_mutex_lock(&arena_landed_mu);
    uint64_t len = arena_landed_len;
    for (uint64_t i = 0; i < len; i++) {
        const uint64_t *e = arena_landed + 4 * i;
        (void)arena_put((uint32_t)e[0], e[1], e[2], e[3]);
    }
    __atomic_store_n(&arena_landed_len, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&arena_landed_mu);
}

/* Members that left the arena (`n`, 4 uint64 each as for shardfs_shim_arena_landed): the
 * table forgets each it still has there. With serve_mu: their bytes are about to be reused. */
void shardfs_shim_arena_gone(const uint64_t *flat, uint64_t n)
{
    arena_take_landed();   /* a landing told before a leaving is undone by it */
    for (uint64_t i = 0; i < n; i++) {
        const uint64_t *g = flat + 4 * i;
        struct arena_slot *e = arena_find(g[0] + 1, g[1]);
        if (e != NULL && e->at == g[2] && e->gen == g[3])
            arena_remove(e);
    }
}

/* Members the table holds (tests, stats; with serve_mu). */
uint64_t shardfs_shim_arena_count(void)
{
    arena_take_landed();
    return arena_count;
}

/* Copy bytes [off, off + n) of the member at `member_off` of `shard` into `buf` if the arena
 * holds it: 1, with the read recorded in `taken`; 0 when Python must answer. */
static int arena_copy(uint32_t shard, uint64_t member_off, uint64_t off, size_t n, char *buf)
{
    arena_take_landed();
    if (arena_count == 0 || n == 0 || *arena_taken_len >= arena_taken_cap)
        return 0;
    struct arena_slot *e = arena_find((uint64_t)shard + 1, member_off);
    if (e == NULL)
        return 0;
    if (e->at + off + n > arena_size) {   /* not this member's bytes: never guess */
        arena_remove(e);
        return 0;
    }
    const uint64_t *gen = &arena_gens[e->at / ARENA_BLOCK];
    if (__atomic_load_n(gen, __ATOMIC_ACQUIRE) != e->gen) {
        arena_remove(e);   /* freed since it was told (its "gone" is on its way) */
        return 0;
    }
    memcpy(buf, arena_data + e->at + off, n);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);   /* the copy's loads before the second check */
    if (__atomic_load_n(gen, __ATOMIC_RELAXED) != e->gen) {
        arena_remove(e);
        return 0;
    }
    uint64_t *rec = &arena_taken[4 * (*arena_taken_len)++];
    rec[0] = shard;
    rec[1] = member_off;
    rec[2] = e->at;
    rec[3] = n;
    return 1;
}

/* arena_copy for Python (tests): the n bytes into buf, or -1 (not in the table, or freed). */
int64_t shardfs_shim_arena_read(uint32_t shard, uint64_t member_off, uint64_t off, uint64_t n,
                                char *buf)
{
    return arena_copy(shard, member_off, off, (size_t)n, buf) ? (int64_t)n : -1;
}
