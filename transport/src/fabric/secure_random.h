// Unpredictable bits for memory keys and nonces: the kernel's CSPRNG (getrandom(2)), fetched a
// block at a time per thread, so that a registration or a window bind on the IO path costs no
// system call (one getrandom per 128 draws). A forked child never reuses its parent's block
// (pthread_atfork bumps a generation that every block checks): fio forks its jobs.
#pragma once

#include <cstdint>

namespace ibtrs {

// 32 uniformly random bits. Any thread. Aborts only if the kernel has no getrandom and
// /dev/urandom cannot be read either (no source of randomness at all).
uint32_t secure_random_u32();

}  // namespace ibtrs
