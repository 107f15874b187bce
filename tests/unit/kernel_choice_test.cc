// Which CUDA kernel forms run (kernels/cuda/backend/kernel_choice.h), without a GPU: the flags'
// names, and a test's scoped choice over the flags' (the environment is read once per process;
// gpu-check runs its binaries with it).
#include "kernels/cuda/backend/kernel_choice.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace attnd::cuda {
namespace {

TEST(KernelChoice, EveryNameParsesAndNothingElse) {
  for (const std::string& n : CudaMlaNames()) {
    CudaKernelChoice c;
    EXPECT_TRUE(ParseCudaMla(n, &c)) << n;
  }
  CudaKernelChoice c;
  ASSERT_TRUE(ParseCudaMla("flashinfer", &c));
  EXPECT_EQ(c.library_mla, LibraryMla::kFlashInfer);
  EXPECT_EQ(c.mla, MlaKernel::kDefault);  // where FlashInfer does not apply: the default
  ASSERT_TRUE(ParseCudaMla("simt", &c));
  EXPECT_EQ(c.mla, MlaKernel::kSimt);
  EXPECT_EQ(c.library_mla, LibraryMla::kOff);
  ASSERT_TRUE(ParseCudaMla("mma", &c));
  EXPECT_EQ(c.mla, MlaKernel::kMma);
  EXPECT_FALSE(ParseCudaMla("Simt", &c));
  EXPECT_FALSE(ParseCudaMla("", &c));
  EXPECT_FALSE(ParseCudaIndexer("mma", &c));
  EXPECT_TRUE(ParseCudaTopK("flashinfer", &c));
  EXPECT_EQ(c.topk, TopKKernel::kFlashInfer);
  EXPECT_FALSE(ParseCudaTopK("radix", &c));
}

TEST(KernelChoice, ATestsScopeWinsOverTheFlagsAndEndsWithIt) {
  if (std::getenv("ATTND_CUDA_MLA") || std::getenv("ATTND_CUDA_INDEXER") ||
      std::getenv("ATTND_CUDA_TOPK"))
    GTEST_SKIP() << "an ATTND_CUDA_* variable is set: it sits between the flags and the scope";
  CudaKernelChoice flags;
  ASSERT_TRUE(ParseCudaMla("mma", &flags));
  ASSERT_TRUE(ParseCudaTopK("flashinfer", &flags));
  SetFlagKernelChoice(flags);
  EXPECT_TRUE(TensorCoreMla());
  EXPECT_FALSE(PipelinedMla());
  EXPECT_TRUE(FlashInferTopK());
  {
    ScopedKernelChoice simt(false, false);
    ScopedTopK attnd(TopKKernel::kAttnd);
    EXPECT_FALSE(TensorCoreMla());
    EXPECT_FALSE(TensorCoreIndexer());
    EXPECT_FALSE(FlashInferTopK());
    {
      ScopedLibraryMla fi(LibraryMla::kGemm);
      EXPECT_TRUE(GemmMla());
      EXPECT_FALSE(TensorCoreMla());  // the hand-written choice stays beside the library one
    }
    EXPECT_FALSE(GemmMla());
    ScopedKernelChoice ws(true, true, true, true);
    EXPECT_TRUE(WgmmaMla());
    EXPECT_TRUE(WgmmaWsMla());
  }
  EXPECT_FALSE(PipelinedMla());  // the flags' again
  EXPECT_TRUE(FlashInferTopK());
  SetFlagKernelChoice(CudaKernelChoice{});
  EXPECT_TRUE(PipelinedMla());
  EXPECT_FALSE(FlashInferTopK());
  EXPECT_EQ(LibraryMlaChoice(), LibraryMla::kOff);
}

}  // namespace
}  // namespace attnd::cuda
