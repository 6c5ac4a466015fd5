// A migration-image Volume (ibnbd/migrate_image.h) over a local block device or file opened
// O_DIRECT: how the soak checker drives /dev/ublkbN or /dev/nbdN (the VM slice) or any file.
#pragma once

#include <memory>
#include <string>

#include "ibnbd/migrate_image.h"

namespace ibnbd::soak {

// Requests run on `threads` worker threads with pread/pwrite (RWF_DSYNC for FUA, fdatasync for
// FLUSH); completions run there. The logical block is the device's (BLKSSZGET) or 512 for a
// file. Errors: open(2)'s (EINVAL: the filesystem refuses O_DIRECT), EINVAL (a size that is
// not a multiple of 4096 or 0).
ibtrs::Result<std::unique_ptr<migrate::Volume>> file_volume(const std::string& path, unsigned threads,
                                                            uint32_t* logical_block);

}  // namespace ibnbd::soak
