// libibtrs reports errors as base's Result<T> / Status (a value or a std::error_code in errno's
// category; base/result.h). Its API names them ibtrs::Result, ibtrs::Status and ibtrs::errc.
#pragma once

#include "base/result.h"

namespace ibtrs {

using base::errc;
using base::Result;
using base::Status;

}  // namespace ibtrs
